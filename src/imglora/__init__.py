"""imglora: LoRA training for image models (and chat LLMs) on rented GPUs."""

from .util.version import __version__

__all__ = ["__version__"]
