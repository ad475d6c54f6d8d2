"""Training data. Synthetic long-range data until the real long-text data lands."""

from .synthetic import SyntheticCopyData

__all__ = ["SyntheticCopyData"]
