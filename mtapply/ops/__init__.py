"""Op specifications: one module per optimizer, one row per op in REGISTRY."""
from .adam import AdamSpec
from .adam8bit import Adam8bitSpec
from .lamb import LAMBSpec
from .lars import LARSSpec
from .norms import ClipGradNormSpec, L2NormSpec
from .scaling import AddSpec, ScaleSpec, UnscaleSpec, ZeroSpec
from .sgd import SGDSpec

REGISTRY = {"adam": AdamSpec, "sgd": SGDSpec, "lars": LARSSpec, "lamb": LAMBSpec}
# List utilities: ops of the same engine that are not optimizers.
UTILITIES = {"l2norm": L2NormSpec, "clip_grad_norm": ClipGradNormSpec, "scale": ScaleSpec,
             "unscale": UnscaleSpec, "add": AddSpec, "zero": ZeroSpec}

__all__ = ["AddSpec", "Adam8bitSpec", "AdamSpec", "ClipGradNormSpec", "L2NormSpec", "LAMBSpec", "LARSSpec", "REGISTRY",
           "SGDSpec", "ScaleSpec", "UTILITIES", "UnscaleSpec", "ZeroSpec"]
