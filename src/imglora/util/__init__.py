"""Small helpers every layer uses: atomic writes, devices and dtypes, processes, hashes, the home
folder, owned tensors, per-sample random draws, the version."""
