"""Op specifications: one module per optimizer, one row per op in REGISTRY."""
from .adam import AdamSpec
from .lamb import LAMBSpec
from .lars import LARSSpec
from .sgd import SGDSpec

REGISTRY = {"adam": AdamSpec, "sgd": SGDSpec, "lars": LARSSpec, "lamb": LAMBSpec}

__all__ = ["AdamSpec", "LAMBSpec", "LARSSpec", "REGISTRY", "SGDSpec"]
