"""``python -m imglora ...`` (what ``accelerate launch -m imglora`` runs) is the ``imglora`` command."""

from .cli import main

main()
