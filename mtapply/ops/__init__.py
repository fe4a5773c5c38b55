"""Op specifications: one module per optimizer, one row per op in REGISTRY."""
from .adam import AdamSpec
from .sgd import SGDSpec

REGISTRY = {"adam": AdamSpec, "sgd": SGDSpec}

__all__ = ["AdamSpec", "REGISTRY", "SGDSpec"]
