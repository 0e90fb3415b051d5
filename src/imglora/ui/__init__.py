"""``imglora ui``: the web page over run folders (server.py), and what it reads of them (runs.py)."""
