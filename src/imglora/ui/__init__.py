"""``imglora ui``: the web page over run folders (server.py), its request checks (guard.py), the
commands it starts (jobs.py), and what it reads of the run folders (run_folders.py)."""
