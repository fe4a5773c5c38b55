"""LARS with momentum (fp32, lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.001,
eps=0; 1-D tensors excluded): data, competitors, targets.

Per tensor: local_lr = lr * trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps), or
lr when a norm is zero; v = momentum * v + local_lr * (g + weight_decay * p); p = p - v. Biases and
batch-norm parameters (the 1-D tensors) take plain momentum steps with lr and no weight decay, as
LARS training recipes do. Every competitor gets its own copy of the same random initial data and
returns a `Stepper` whose `step()` performs one optimizer step with the gradients already in place.
"""
from __future__ import annotations

from dataclasses import dataclass

from .common import (Competitor, JaxLoop, Stepper, TensorLists, fused_step,
                     generator, graph_stepper, import_jax, jax_lists, optax_state, randn_list,
                     transformation_step)

NAME = "lars"
DESCRIPTION = ("lars fp32, lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=0.001, "
               "eps=0, 1-D tensors excluded")
BYTES_PER_PARAM = 20  # read p, g, v and write p, v: 5 fp32 words per parameter
REFERENCE = "torch-loop"  # the peer every row's time is divided by
DEFAULT_WORKLOADS = ("resnet50",)
# GPU time over the byte floor, and wall time over the per-tensor loop's: the loop launches
# several kernels per tensor, so its cost is host time, which only the wall clock shows.
TARGETS = {"resnet50": (("x_floor", 1.45), ("x_torch_loop_wall", 0.1))}
LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-4
TRUST_COEFFICIENT = 0.001
EPS = 0.0


@dataclass
class LARSData(TensorLists):
    params: list
    grads: list
    momentum_buffers: list

    def exclude(self) -> list:
        """True for each 1-D tensor (biases, batch-norm weights and biases)."""
        return [p.dim() == 1 for p in self.params]


def make_data(shapes, device, seed: int = 0) -> LARSData:
    """Random tensors (never zeros, which can flatter a kernel) at the scales of a network's
    weights, gradients and momentum buffers mid-training."""
    gen = generator(device, seed)
    params = randn_list(shapes, gen, 0.05)
    grads = randn_list(shapes, gen, 0.01)
    momentum_buffers = randn_list(shapes, gen, 0.001)
    return LARSData(params, grads, momentum_buffers)


def mtapply_plan(data: LARSData) -> Stepper:
    """mtapply as a user calls it: bind the lists once, then one `plan.step` per step."""
    import mtapply

    plan = mtapply.lars_plan(*data.lists(), exclude=data.exclude())

    def step():
        plan.step(lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY,
                  trust_coefficient=TRUST_COEFFICIENT, eps=EPS)

    return Stepper(step, plan, data)


def torch_loop(data: LARSData) -> Stepper:
    exclude = data.exclude()
    return Stepper(lambda: _torch_lars(data, exclude, LR), data)


def torch_loop_graph(data: LARSData) -> Stepper:
    """The same loop replayed from a CUDA graph; the lr is a device tensor, as a schedule under
    a graph needs."""
    import torch

    exclude = data.exclude()
    lr = torch.tensor(LR, device=data.params[0].device)
    return graph_stepper(lambda: _torch_lars(data, exclude, lr), lr, data)


def _torch_lars(data: LARSData, exclude: list, lr) -> None:
    """One LARS step as a per-tensor PyTorch loop. The trust ratio stays on the device
    (torch.where, no .item()), so the loop never waits for the GPU. `lr`: a number or a
    0-dim device tensor."""
    import torch

    for p, g, v, excluded in zip(*data.lists(), exclude):
        if excluded:
            v.mul_(MOMENTUM).add_(g * lr)
        else:
            p_norm, g_norm = p.norm(), g.norm()
            trust = lr * TRUST_COEFFICIENT * p_norm / (g_norm + WEIGHT_DECAY * p_norm + EPS)
            local_lr = torch.where((p_norm > 0) & (g_norm > 0), trust, lr)
            v.mul_(MOMENTUM).add_(g.add(p, alpha=WEIGHT_DECAY).mul_(local_lr))
        p.sub_(v)


def optax_lars_jit(data: LARSData) -> Stepper:
    """optax.lars under jax.jit on JAX copies of the data, params and state donated. optax orders
    the operations its own way (weight decay, trust ratio, lr, then momentum), so this row is for
    timing only. JAX runs on its own streams: the harness times it by wall clock, waiting with
    jax.block_until_ready."""
    jax, optax = import_jax()
    params, grads, buffers = jax_lists(data.lists())
    adapt = [not excluded for excluded in data.exclude()]
    optimizer = optax.lars(learning_rate=LR, weight_decay=WEIGHT_DECAY, weight_decay_mask=adapt,
                           trust_coefficient=TRUST_COEFFICIENT, eps=EPS, trust_ratio_mask=adapt,
                           momentum=MOMENTUM)
    # Mid-training momentum, as the other competitors have (optax would start from zeros).
    state = optax_state(optimizer, params, trace=buffers)
    return JaxLoop(transformation_step(optimizer), params, state, grads).stepper()


def mtapply_optax(data: LARSData, fused: bool) -> Stepper:
    """mtapply.optax.lars (an optax transformation) or fused_lars in jax.jit on JAX copies of
    the data, params and state donated; the state starts with the data's momentum (mtapply
    keeps the velocity itself, optax.lars its negative)."""
    import mtapply.optax as mtx

    params, grads, buffers = jax_lists(data.lists())
    adapt = [not excluded for excluded in data.exclude()]
    hyper = dict(learning_rate=LR, weight_decay=WEIGHT_DECAY, weight_decay_mask=adapt,
                 trust_coefficient=TRUST_COEFFICIENT, eps=EPS, trust_ratio_mask=adapt,
                 momentum=MOMENTUM)
    optimizer = (mtx.fused_lars if fused else mtx.lars)(**hyper)
    state = mtx.flat_state(optimizer.init(params)._replace(momentum=buffers), params)
    step = fused_step(optimizer) if fused else transformation_step(optimizer)
    return JaxLoop(step, params, state, grads).stepper()


COMPETITORS = {
    "mtapply": Competitor(mtapply_plan, "mtapply.lars_plan(..., exclude=1-D tensors), "
                                        "table_mode='memcpy' (the default)"),
    "torch-loop": Competitor(torch_loop, "per-tensor PyTorch loop, trust ratio on the device "
                                         "(torch.where, no .item())"),
    "torch-loop-graph": Competitor(torch_loop_graph, "the same loop, lr a device tensor, "
                                                     "CUDA graph replay"),
    "optax-lars-jit": Competitor(optax_lars_jit, "optax.lars under jax.jit, params and state "
                                                 "donated; wall clock only (JAX's own streams)"),
    "mtapply-optax": Competitor(lambda data: mtapply_optax(data, fused=False),
                                "mtapply.optax.lars under jax.jit, params and state donated"),
    "mtapply-optax-fused": Competitor(lambda data: mtapply_optax(data, fused=True),
                                      "mtapply.optax.fused_lars(...).step under jax.jit, params "
                                      "and state donated"),
}
