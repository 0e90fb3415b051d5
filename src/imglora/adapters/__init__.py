"""The adapters: injection through peft, per-block ranks, each adapter type's form in ComfyUI's key
layout, OFT, and output preservation (a prediction with the adapter off)."""
