"""Op specifications: one module per optimizer, one row per op in REGISTRY."""
from .adam import AdamSpec

REGISTRY = {"adam": AdamSpec}

__all__ = ["AdamSpec", "REGISTRY"]
