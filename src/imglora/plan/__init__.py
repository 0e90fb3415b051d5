"""Memory and time before a GPU is rented: the memory plan (term by term, from a meta-device run),
seconds per update, the budget at the start of a run, and bench agreement."""
