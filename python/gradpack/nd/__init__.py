"""Operators on numpy arrays, named as in ``mx.nd``."""
from . import contrib

__all__ = ["contrib"]
