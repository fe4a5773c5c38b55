"""Adam (lr=1e-3, default betas, eps=1e-8, no weight decay): data, competitors, targets.

fp32 unless the workload says otherwise. On gpt2-bf16 (bf16 params and grads, fp32 moments)
mtapply updates fp32 master weights and writes the bf16 params rounded from them. torch.optim.Adam
has no master weights and keeps its moments in the params' dtype, so its bf16 step moves half the
bytes: its rows are the peer a bf16 user has, not the same work, and say so. torch-fused-fp32 runs
torch's fused step on fp32 copies of the same values, the fp32 reference point.

Every competitor gets its own copy of the same random initial data and returns a `Stepper`
whose `step()` performs one optimizer step with the gradients already in place.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .common import (Competitor, JaxLoop, Stepper, TensorLists, attach_grads, cast_list,
                     fused_step, generator, graph_stepper, import_jax, jax_lists, optax_state,
                     randn_list, transformation_step)
from .workloads import BF16_MASTER, FP32, ITEMSIZE, Dtypes

NAME = "adam"
DESCRIPTION = ("adam, lr=1e-3, eps=1e-8, weight_decay=0; fp32 unless the workload says otherwise "
               "(gpt2-bf16: bf16 params and grads, fp32 moments and master weights)")
BYTES_PER_PARAM = 28  # fp32: read p, g, m, v, write p, m, v (7 words); see bytes_per_param
DTYPES = (FP32, BF16_MASTER)  # the workload dtypes make_data takes
REFERENCE = "torch-fused"  # the peer every row's time is divided by
DEFAULT_WORKLOADS = ("big256M", "gpt2-124M", "gpt2-bf16", "small10k", "tiny2k")
# workload -> (metric, limit) for mtapply's rows. "x_floor" is GPU time over the byte floor;
# tiny lists are launch-bound, so there the target is wall-clock microseconds per step.
TARGETS = {
    "big256M": ("x_floor", 1.05),
    "gpt2-124M": ("x_floor", 1.05),
    "small10k": ("x_floor", 1.10),
    "tiny2k": ("wall_us", 20.0),
}
LR = 1e-3
EPS = 1e-8
MASTER_NOTE = ("master_params: reads the fp32 master weights (not the bf16 params), writes them "
               "and the bf16 params rounded from them")


def bytes_per_param(dtypes: Dtypes) -> int:
    """Bytes one step moves per parameter: read the weights it updates (the master copy where
    there is one), g, m, v; write those weights, m, v, and beside a master the rounded params.
    fp32: 28. bf16 params and grads with fp32 master and moments: read 4+2+4+4, write 4+2+4+4,
    28. torch's bf16 step (bf16 moments, no master): 14."""
    weights = ITEMSIZE[dtypes.master or dtypes.params]
    rounded = ITEMSIZE[dtypes.params] if dtypes.master else 0
    return 2 * weights + rounded + ITEMSIZE[dtypes.grads] + 4 * ITEMSIZE[dtypes.states]


@dataclass
class AdamData(TensorLists):
    params: list
    grads: list
    exp_avgs: list
    exp_avg_sqs: list

    def plan_options(self) -> dict:
        """adam_plan's keyword lists beyond the four positional ones."""
        return {}


@dataclass
class MasterAdamData(AdamData):
    """Low-precision params and grads beside fp32 moments and the fp32 master weights that the
    params are rounded from."""

    master_params: list

    def plan_options(self) -> dict:
        return {"master_params": self.master_params}

    def fp32(self) -> AdamData:
        """The same values all in fp32, the master weights as the params."""
        return AdamData(self.master_params, cast_list(self.grads, "float32"), self.exp_avgs,
                        self.exp_avg_sqs)


def make_data(shapes, device, seed: int = 0, dtypes: Dtypes = FP32) -> AdamData:
    """Random tensors (never zeros, which can flatter a kernel): states as if mid-training.
    Every dtype draws the same numbers; beside a master copy the params are rounded from it,
    as a mixed-precision training loop keeps them."""
    import torch

    gen = generator(device, seed)
    params = randn_list(shapes, gen)
    grads = randn_list(shapes, gen)
    exp_avgs = randn_list(shapes, gen, 0.1)
    exp_avg_sqs = [torch.rand(s, generator=gen, device=gen.device) for s in shapes]
    lists = (cast_list(params, dtypes.params), cast_list(grads, dtypes.grads),
             cast_list(exp_avgs, dtypes.states), cast_list(exp_avg_sqs, dtypes.states))
    if dtypes.master is None:
        return AdamData(*lists)
    return MasterAdamData(*lists, cast_list(params, dtypes.master))


def mtapply_plan(data: AdamData, table_mode: str) -> Stepper:
    """mtapply as a user calls it: bind the lists once, then one `plan.step` per step."""
    import mtapply

    options = data.plan_options()
    plan = mtapply.adam_plan(data.params, data.grads, data.exp_avgs, data.exp_avg_sqs,
                             table_mode=table_mode, **options)
    counter = itertools.count(1)

    def step():
        plan.step(lr=LR, step=next(counter))

    return Stepper(step, plan, data, note=MASTER_NOTE if "master_params" in options else None)


def mtapply_rule(data: AdamData) -> Stepper:
    """The same Adam written as a rule (`mtapply.rules.library.adam`): the generated kernel
    beside the hand-written one."""
    from mtapply.rules import library

    plan = library.adam().plan(data.params, data.grads, data.exp_avgs, data.exp_avg_sqs)
    counter = itertools.count(1)

    def step():
        plan.step(lr=LR, step=next(counter), eps=EPS)

    return Stepper(step, plan, data)


def mtapply_call(data: AdamData) -> Stepper:
    """mtapply as the one-call API is used: `mtapply.adam_step(...)` on the same lists every
    step (each call checks the lists, then reuses the tables of the last call)."""
    import mtapply

    options = data.plan_options()
    counter = itertools.count(1)

    def step():
        mtapply.adam_step(data.params, data.grads, data.exp_avgs, data.exp_avg_sqs, lr=LR,
                          step=next(counter), **options)

    return Stepper(step, data, note=MASTER_NOTE if "master_params" in options else None)


def optax_jit(data: AdamData) -> Stepper:
    """optax.adam under jax.jit on JAX copies of the data, params and state donated."""
    jax, optax = import_jax()
    params, grads, mu, nu = jax_lists(data.lists())
    optimizer = optax.adam(LR, eps=EPS)
    state = optax_state(optimizer, params, mu=mu, nu=nu)
    return JaxLoop(transformation_step(optimizer), params, state, grads).stepper()


def mtapply_optax(data: AdamData, fused: bool) -> Stepper:
    """mtapply.optax.adam (an optax transformation) or fused_adam under jax.jit on JAX copies
    of the data, params and state donated."""
    import mtapply.optax as mtx

    params, grads, mu, nu = jax_lists(data.lists())
    optimizer = (mtx.fused_adam if fused else mtx.adam)(LR, eps=EPS)
    state = mtx.flat_state(optimizer.init(params)._replace(mu=mu, nu=nu), params)
    step = fused_step(optimizer) if fused else transformation_step(optimizer)
    return JaxLoop(step, params, state, grads).stepper()


def torch_fused(data: AdamData) -> Stepper:
    opt = _torch_adam(data, lr=LR, fused=True)
    return Stepper(opt.step, opt, data, **_torch_notes(data))


def torch_foreach(data: AdamData) -> Stepper:
    opt = _torch_adam(data, lr=LR, foreach=True)
    return Stepper(opt.step, opt, data, **_torch_notes(data))


def torch_fused_graph(data: AdamData) -> Stepper:
    """Fused Adam replayed from a CUDA graph: capture needs a tensor lr and capturable=True."""
    import torch

    lr = torch.tensor(LR, device=data.params[0].device)
    opt = _torch_adam(data, lr=lr, fused=True, capturable=True)
    return graph_stepper(opt.step, opt, lr, data, **_torch_notes(data))


def torch_fused_fp32(data: MasterAdamData) -> Stepper:
    """torch's fused step on fp32 copies of the mixed-precision data: what the same model costs
    in fp32, with the floor's 28 B/param."""
    fp32 = data.fp32()
    opt = _torch_adam(fp32, lr=LR, fused=True)
    return Stepper(opt.step, opt, fp32, note="fp32 copies of the same values (params from the "
                                             "master weights): the fp32 reference point")


def _torch_adam(data: AdamData, **options):
    """torch.optim.Adam over `data`, its state preset to `data`'s moments (its lazy init
    would make them zeros), stored in the params' dtype as torch keeps them."""
    import torch

    attach_grads(data.params, data.grads)
    opt = torch.optim.Adam(data.params, eps=EPS, weight_decay=0.0, **options)
    # Where torch.optim.Adam keeps `step`: on the device for fused/capturable, else on the host.
    on_device = options.get("fused") or options.get("capturable")
    for p, m, v in zip(data.params, data.exp_avgs, data.exp_avg_sqs):
        step = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        opt.state[p] = {"step": step, "exp_avg": m.to(p.dtype), "exp_avg_sq": v.to(p.dtype)}
    return opt


def _torch_notes(data: AdamData) -> dict:
    """Stepper keywords for torch.optim.Adam on low-precision params, which does other work
    than the floor counts: moments in the params' dtype, no master weights."""
    params, grads = (str(tensors[0].dtype).removeprefix("torch.")
                     for tensors in (data.params, data.grads))
    if params == "float32":
        return {}
    moves = bytes_per_param(Dtypes(params=params, grads=grads, states=params))
    return {"moves": moves,
            "note": f"torch keeps the moments in the params' dtype ({params}) and has no master "
                    f"weights: it moves {moves} B/param"}


COMPETITORS = {
    "mtapply": Competitor(lambda data: mtapply_plan(data, "memcpy"),
                          "mtapply.adam_plan(...), table_mode='memcpy' (the default); "
                          "master_params= where the workload has master weights"),
    "mtapply-unified": Competitor(lambda data: mtapply_plan(data, "unified"),
                                  "mtapply.adam_plan(..., table_mode='unified')"),
    "mtapply-call": Competitor(mtapply_call, "mtapply.adam_step(...) every step on the same "
                                             "lists (the one-call API)"),
    "mtapply-rule": Competitor(mtapply_rule, "Adam written as an mtapply.rule, plan bound once",
                               fp32_only=True),
    "torch-fused": Competitor(torch_fused, "torch.optim.Adam(fused=True); moments in the "
                                           "params' dtype"),
    "torch-fused-fp32": Competitor(torch_fused_fp32, "torch.optim.Adam(fused=True) on fp32 "
                                                     "copies of the same values",
                                   mixed_only=True),
    "torch-fused-graph": Competitor(
        torch_fused_graph, "torch.optim.Adam(fused=True, capturable=True), CUDA graph replay"),
    "torch-foreach": Competitor(torch_foreach, "torch.optim.Adam(foreach=True)"),
    "optax-jit": Competitor(optax_jit, "optax.adam under jax.jit, params and state donated; "
                                       "wall clock only (JAX's own streams)", fp32_only=True),
    "mtapply-optax": Competitor(lambda data: mtapply_optax(data, fused=False),
                                "mtapply.optax.adam under jax.jit, params and state donated",
                                fp32_only=True),
    "mtapply-optax-fused": Competitor(lambda data: mtapply_optax(data, fused=True),
                                      "mtapply.optax.fused_adam(...).step under jax.jit, params "
                                      "and state donated", fp32_only=True),
}
