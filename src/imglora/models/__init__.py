"""Where model weights come from: resolving model.path, sources and their checksums, fetching, safe
single files, ComfyUI's model folders, and the tiny offline models."""
