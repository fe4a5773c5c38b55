"""mtapply: fused multi-tensor optimizer updates for any framework, through DLPack.

    mtapply.adam_step(params, grads, exp_avgs, exp_avg_sqs, lr=1e-3, step=1)
    mtapply.sgd_step(params, grads, momentum_buffers, lr=0.1, step=1, momentum=0.9)

updates whole lists of tensors in one kernel launch per (device, dtype) group on the GPU, or
with NumPy on the CPU. `mtapply.adam_plan(...)` binds the lists once for O(1)-host-cost steps.
List utilities: `l2_norms`, `clip_grad_norm_`, `scale_`, `unscale_` (AMP), `add_`, `zero_`.
`mtapply.adam8bit_step(...)` keeps Adam's moments in 8 bits (`mtapply.adam8bit_state`).
`mtapply.rule(...)` makes a fused optimizer of a few lines of update (see `mtapply.rules`);
`mtapply.chain(...)` fuses gradient transformations (`mtapply.rules.chain`) into one.
"""
from .adam import adam_plan, adam_step
from .adam8bit import Adam8bitState, adam8bit_plan, adam8bit_state, adam8bit_step
from .galore import GaLoreState, galore_adamw_step, galore_state
from .lamb import LAMBSpec, lamb_plan, lamb_step
from .lars import LARSSpec, lars_plan, lars_step
from .norms import clip_grad_norm_, l2_norms
from .ops import AdamSpec
from .plan import Plan
from .rules import Rule, rule
from .rules.chain import Link, chain
from .scaling import add_, scale_, unscale_, zero_
from .sgd import SGDSpec, sgd_plan, sgd_step

# the shipped optimizers' ops by name
REGISTRY = {"adam": AdamSpec, "sgd": SGDSpec, "lars": LARSSpec, "lamb": LAMBSpec}

__version__ = "0.1.0"

__all__ = ["add_", "Adam8bitState", "AdamSpec", "LAMBSpec", "LARSSpec", "Link", "Plan", "REGISTRY", "Rule", "SGDSpec", "chain",
           "adam8bit_plan", "adam8bit_state", "adam8bit_step", "adam_plan", "adam_step",
           "GaLoreState", "galore_adamw_step", "galore_state", "clip_grad_norm_", "l2_norms", "lamb_plan", "lamb_step", "lars_plan",
           "lars_step", "rule", "scale_", "sgd_plan", "sgd_step", "unscale_", "zero_", "__version__"]
