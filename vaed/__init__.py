"""vaed: remote Wan video VAE decoding over gRPC."""

__version__ = "0.1.0"
