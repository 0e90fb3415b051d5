"""imglora: LoRA training for SDXL and FLUX.1-dev, built for rented GPUs."""

__version__ = "0.1.0"
