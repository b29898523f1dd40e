"""numwatch: a training-time numerical health monitor for PyTorch."""

__version__ = "0.1.0"
