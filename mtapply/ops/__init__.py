"""Op specifications written by hand: one module per op (SGD, LARS, LAMB and the rule-built
optimizers are declared as rules: mtapply.rules)."""
from .adam import AdamSpec
from .adam8bit import Adam8bitSpec
from .norms import ClipGradNormSpec, L2NormSpec
from .scaling import AddSpec, ScaleSpec, UnscaleSpec, ZeroSpec

# List utilities: ops of the same engine that are not optimizers.
UTILITIES = {"l2norm": L2NormSpec, "clip_grad_norm": ClipGradNormSpec, "scale": ScaleSpec,
             "unscale": UnscaleSpec, "add": AddSpec, "zero": ZeroSpec}

__all__ = ["AddSpec", "Adam8bitSpec", "AdamSpec", "ClipGradNormSpec", "L2NormSpec",
           "ScaleSpec", "UTILITIES", "UnscaleSpec", "ZeroSpec"]
