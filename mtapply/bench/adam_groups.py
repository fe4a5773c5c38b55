"""AdamW (fp32) with one param group per tensor, each group its own lr and weight decay (as
per-layer learning rates and decay masks make them): mtapply.torch.AdamW (with and without
`flat_grads`) against torch.optim.AdamW, fused and foreach, on the same groups. Each group
steps every time; the floor is the fp32 Adam step's 28 bytes per param whatever the groups.
Before each flat_grads step the flat buffers are marked written, as backward marks them in
training (with no kernel), so that the step is the one a training loop takes.
In JAX the same lrs and decays are labels of optax.multi_transform (ten labels): of
optax.adamw's, of mtapply.optax.adamw's (a call per label), mtapply.optax.multi_transform (one
call) and its fused form (one call, params updated in place).
"""
from __future__ import annotations

from .adam import AdamData
from .adam import make_data as make_adam_data
from .common import (Competitor, JaxLoop, Stepper, attach_grads, fused_step, import_jax,
                     jax_lists, transformation_step)

NAME = "adam-groups"
DESCRIPTION = "adamw fp32, one param group per tensor (lr 1e-4 .. 5e-4, weight decay 0 or 0.01)"
BYTES_PER_PARAM = 28
REFERENCE = "torch-fused"
DEFAULT_WORKLOADS = ("gpt2-124M", "resnet50", "resnet152")
TARGETS = {"gpt2-124M": ("x_floor", 1.1), "resnet152": ("x_floor", 1.1)}


def make_data(shapes, device, seed: int = 0) -> AdamData:
    return make_adam_data(shapes, device, seed)


def groups(params: list) -> list:
    """One group per tensor: lr by the tensor's position, no decay on 1-D tensors."""
    return [{"params": [p], "lr": _lr(k), "weight_decay": _decay(p.dim())}
            for k, p in enumerate(params)]


def _lr(position: int) -> float:
    return 1e-4 * (1 + position % 5)


def _decay(ndim: int) -> float:
    return 0.0 if ndim == 1 else 0.01


def optax_labels(data: AdamData, adamw_of: str, combined_by: str) -> Stepper:
    """optax.multi_transform, mtapply.optax.multi_transform or its fused form (`combined_by`:
    "optax", "mtapply" or "mtapply-fused") of optax's or mtapply.optax's adamws (`adamw_of`),
    one per (lr, weight decay) of `groups`, under jax.jit on JAX copies of the data, params and
    state donated."""
    _, optax = import_jax()
    import mtapply.optax as mtx

    fused = combined_by == "mtapply-fused"
    adamw = mtx.fused_adamw if fused else {"optax": optax, "mtapply": mtx}[adamw_of].adamw
    params, grads = jax_lists([data.params, data.grads])
    hyper = [(_lr(k), _decay(p.dim())) for k, p in enumerate(data.params)]
    labels = [f"lr {lr}, weight decay {decay}" for lr, decay in hyper]
    transforms = {label: adamw(lr, weight_decay=decay) for label, (lr, decay) in zip(labels, hyper)}
    combine = {"optax": optax.multi_transform, "mtapply": mtx.multi_transform,
               "mtapply-fused": mtx.fused_multi_transform}[combined_by]
    optimizer = combine(transforms, labels)
    step = fused_step(optimizer) if fused else transformation_step(optimizer)
    return JaxLoop(step, params, optimizer.init(params), grads).stepper()


def _preset(opt, data: AdamData, on_device: bool) -> None:
    """The moments of `data` as the optimizer's state (its lazy init would make them zeros)."""
    import torch

    for p, m, v in zip(data.params, data.exp_avgs, data.exp_avg_sqs):
        step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        opt.state[p] = {"step": step, "exp_avg": m, "exp_avg_sq": v}


def torch_adamw(data: AdamData, **options) -> Stepper:
    import torch

    attach_grads(data.params, data.grads)
    opt = torch.optim.AdamW(groups(data.params), **options)
    _preset(opt, data, on_device=bool(options.get("fused")))
    return Stepper(opt.step, opt, data)


def mtapply_torch(data: AdamData, flat_grads: bool) -> Stepper:
    import torch

    import mtapply.torch as mt

    for p in data.params:
        p.requires_grad_(True)
    opt = mt.AdamW(groups(data.params), flat_grads=flat_grads)
    if not flat_grads:
        attach_grads(data.params, data.grads)
        _preset(opt, data, on_device=False)
        return Stepper(opt.step, opt, data)
    opt.zero_grad()  # the optimizer's grads are views of its flat buffer, made here: fill them
    with torch.no_grad():
        for p, g in zip(data.params, data.grads):
            p.grad.copy_(g)
    _preset(opt, data, on_device=False)
    buffers, written = opt._flat.buffers, torch.autograd.graph.increment_version

    def step() -> None:
        for buffer in buffers:  # as backward's writes into the grads' views do, with no kernel
            written(buffer)
        opt.step()

    return Stepper(step, opt, data)


COMPETITORS = {
    "mtapply-torch": Competitor(lambda data: mtapply_torch(data, flat_grads=False),
                                "mtapply.torch.AdamW(groups).step()"),
    "mtapply-torch-flat": Competitor(lambda data: mtapply_torch(data, flat_grads=True),
                                     "mtapply.torch.AdamW(groups, flat_grads=True).step()"),
    "torch-fused": Competitor(lambda data: torch_adamw(data, fused=True),
                              "torch.optim.AdamW(groups, fused=True)"),
    "torch-foreach": Competitor(lambda data: torch_adamw(data, foreach=True),
                                "torch.optim.AdamW(groups, foreach=True)"),
    "optax-labels": Competitor(lambda data: optax_labels(data, "optax", "optax"),
                               "optax.multi_transform of optax.adamw per (lr, decay) label, "
                               "under jax.jit; wall clock only (JAX's own streams)",
                               fp32_only=True),
    "mtapply-optax-labels": Competitor(
        lambda data: optax_labels(data, "mtapply", "mtapply"),
        "mtapply.optax.multi_transform of mtapply.optax.adamw per label: one call",
        fp32_only=True),
    "mtapply-optax-labels-fused": Competitor(
        lambda data: optax_labels(data, "mtapply", "mtapply-fused"),
        "mtapply.optax.fused_multi_transform of fused_adamw per label: one call, in place",
        fp32_only=True),
    "mtapply-optax-per-label": Competitor(
        lambda data: optax_labels(data, "mtapply", "optax"),
        "optax.multi_transform of mtapply.optax.adamw per label: a call per label",
        fp32_only=True),
}
