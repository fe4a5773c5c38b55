"""AdamW with 8-bit moments (fp32 params and grads; lr=1e-3, wd=0.01): data, competitors,
targets. Peers: bitsandbytes' and torchao's AdamW8bit where they are installed, and the fp32
steps they replace (mtapply's and torch's fused AdamW)."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from .common import (Competitor, Stepper, TensorLists, generator, params_with_grads,
                     randn_list)

NAME = "adam8bit"
DESCRIPTION = ("adamw with 8-bit blockwise moments (mtapply.adam8bit_plan), fp32 params and "
               "grads, lr=1e-3, wd=0.01; moments of params under 4096 elements stay fp32")
BYTES_PER_PARAM = 16  # read p, g, m8, v8 and write p, m8, v8 (+ 2 x 8 bytes of scales per 256)
REFERENCE = "torch-fused"
DEFAULT_WORKLOADS = ("gpt2-124M", "big256M")
TARGETS = {"gpt2-124M": ("x_floor", 1.1)}
LR, WEIGHT_DECAY = 1e-3, 0.01
FP32_BYTES = 28  # what the fp32 AdamW rows move per param


@dataclass
class Adam8bitData(TensorLists):
    params: list
    grads: list
    exp_avgs: list  # float32 moments as if mid-training; each row stores them its own way
    exp_avg_sqs: list


def make_data(shapes, device, seed: int = 0) -> Adam8bitData:
    gen = generator(device, seed)
    return Adam8bitData(randn_list(shapes, gen), randn_list(shapes, gen),
                        randn_list(shapes, gen, 0.1), [x.abs_() for x in randn_list(shapes, gen, 0.01)])


def quantized_state(data: Adam8bitData):
    """mtapply's 8-bit state holding the data's moments (blockwise-quantized)."""
    import torch

    import mtapply
    from mtapply import quantization

    state = mtapply.adam8bit_state(data.params)
    for k, (m, v) in enumerate(zip(data.exp_avgs, data.exp_avg_sqs)):
        if state.exp_avgs[k].dtype == torch.float32:
            state.exp_avgs[k].copy_(m)
            state.exp_avg_sqs[k].copy_(v)
            continue
        for moment, codes, scales, signed in ((m, state.exp_avgs[k], state.exp_avg_absmax[k], True),
                                              (v, state.exp_avg_sqs[k], state.exp_avg_sq_absmax[k],
                                               False)):
            c, s = quantization.quantize_blockwise(moment.cpu().numpy(), signed)
            codes.copy_(torch.from_numpy(c).reshape(codes.shape))
            scales.copy_(torch.from_numpy(s))
    return state


def state_note(state_bytes: int, params) -> str:
    numel = sum(p.numel() for p in params)
    return f"state {state_bytes / max(numel, 1):.3f} B/param"


def mtapply_8bit(data: Adam8bitData) -> Stepper:
    import mtapply

    state = quantized_state(data)
    plan = mtapply.adam8bit_plan(data.params, data.grads, *state.lists(),
                                 decoupled_weight_decay=True)
    counter = itertools.count(1)

    def step():
        plan.step(lr=LR, step=next(counter), weight_decay=WEIGHT_DECAY)

    return Stepper(step, plan, state, data, note=state_note(state.nbytes(), data.params))


def mtapply_fp32(data: Adam8bitData) -> Stepper:
    import mtapply

    plan = mtapply.adam_plan(data.params, data.grads, data.exp_avgs, data.exp_avg_sqs,
                             decoupled_weight_decay=True)
    counter = itertools.count(1)

    def step():
        plan.step(lr=LR, step=next(counter), weight_decay=WEIGHT_DECAY)

    return Stepper(step, plan, data, moves=FP32_BYTES, note="fp32 moments, 8 B/param")



def torch_fused(data: Adam8bitData) -> Stepper:
    import torch

    opt = torch.optim.AdamW(params_with_grads(data), lr=LR, weight_decay=WEIGHT_DECAY,
                            fused=True)
    for p, m, v in zip(data.params, data.exp_avgs, data.exp_avg_sqs):
        opt.state[p].update(step=torch.tensor(0.0, device=p.device), exp_avg=m, exp_avg_sq=v)
    return Stepper(opt.step, opt, data, moves=FP32_BYTES, note="fp32 moments, 8 B/param")


def _optimizer_state_bytes(opt) -> int:
    import torch

    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.numel() > 1:
                inner = getattr(value, "__tensor_flatten__", None)
                parts = [getattr(value, n) for n in inner()[0]] if inner else [value]
                total += sum(x.numel() * x.element_size() for x in parts)
    return total


def _peer(make) -> object:
    def build(data: Adam8bitData) -> Stepper:
        opt = make(params_with_grads(data))
        opt.step()  # creates the state (zero moments, quantized as each peer stores them)
        note = state_note(_optimizer_state_bytes(opt), data.params)
        return Stepper(opt.step, opt, data, note=note)
    return build


def _bitsandbytes(params):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _torchao(params):
    from torchao.optim import AdamW8bit

    return AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY)


COMPETITORS = {
    "mtapply": Competitor(mtapply_8bit, "mtapply.adam8bit_plan(...).step (AdamW)"),
    "mtapply-fp32": Competitor(mtapply_fp32, "mtapply.adam_plan(...).step, fp32 moments"),
    "torch-fused": Competitor(torch_fused, "torch.optim.AdamW(fused=True), fp32 moments"),
    "bnb-8bit": Competitor(_peer(_bitsandbytes), "bitsandbytes.optim.AdamW8bit"),
    "torchao-8bit": Competitor(_peer(_torchao), "torchao.optim.AdamW8bit"),
}
