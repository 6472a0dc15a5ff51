"""specbuild: compile speculation bundles and serve them with lossless speculative decoding."""

__version__ = "0.1.0"
