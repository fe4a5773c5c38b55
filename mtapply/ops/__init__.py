"""Op specifications: one module per optimizer, one row per op in REGISTRY."""
from .adam import AdamSpec
from .lars import LARSSpec
from .sgd import SGDSpec

REGISTRY = {"adam": AdamSpec, "sgd": SGDSpec, "lars": LARSSpec}

__all__ = ["AdamSpec", "LARSSpec", "REGISTRY", "SGDSpec"]
