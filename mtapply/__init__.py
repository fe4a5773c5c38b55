"""mtapply: fused multi-tensor optimizer updates for any framework, through DLPack.

    mtapply.adam_step(params, grads, exp_avgs, exp_avg_sqs, lr=1e-3, step=1)
    mtapply.sgd_step(params, grads, momentum_buffers, lr=0.1, step=1, momentum=0.9)

updates whole lists of tensors in one kernel launch per (device, dtype) group on the GPU, or
with NumPy on the CPU. `mtapply.adam_plan(...)` binds the lists once for O(1)-host-cost steps.
"""
from .adam import adam_plan, adam_step
from .engine import Plan
from .lamb import lamb_plan, lamb_step
from .lars import lars_plan, lars_step
from .ops import REGISTRY, AdamSpec, LAMBSpec, LARSSpec, SGDSpec
from .sgd import sgd_plan, sgd_step

__version__ = "0.1.0"

__all__ = ["AdamSpec", "LAMBSpec", "LARSSpec", "Plan", "REGISTRY", "SGDSpec", "adam_plan",
           "adam_step", "lamb_plan", "lamb_step", "lars_plan", "lars_step", "sgd_plan", "sgd_step",
           "__version__"]
