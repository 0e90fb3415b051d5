"""Export: the ComfyUI-ready writer, its metadata and the ComfyUI workflows."""
