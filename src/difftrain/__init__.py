"""difftrain: train image diffusion models (DDPM family) from a folder of images."""

__version__ = "0.1.0"
