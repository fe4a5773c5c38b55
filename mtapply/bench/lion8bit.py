"""Lion with 8-bit state (fp32 params and grads; the library's Lion rule with `state_bits=8`;
lr=1e-4, betas=(0.9, 0.99), wd=0.1): data, competitors, targets. Peers: bitsandbytes' Lion8bit
where it is installed, and the fp32 Lion it replaces (mtapply's plan)."""
from __future__ import annotations

from dataclasses import dataclass

from .common import (Competitor, Stepper, TensorLists, generator, params_with_grads,
                     randn_list)
from .lion import BETA1, BETA2, LR, WEIGHT_DECAY

NAME = "lion8bit"
DESCRIPTION = ("lion with an 8-bit blockwise exp_avg (the library's rule with_state_bits(8)), fp32 "
               "params and grads, lr=1e-4, wd=0.1; exp_avg of params under 4096 elements stays fp32")
BYTES_PER_PARAM = 14  # read p, g, m8 and write p, m8 (+ 2 x 4 bytes of scales per 256)
REFERENCE = "mtapply-fp32"
DEFAULT_WORKLOADS = ("gpt2-124M", "small10k")
TARGETS = {"gpt2-124M": ("x_floor", 1.1)}
FP32_BYTES = 20


@dataclass
class Lion8bitData(TensorLists):
    params: list
    grads: list
    exp_avgs: list  # float32 moments as if mid-training; each row stores them its own way


def make_data(shapes, device, seed: int = 0) -> Lion8bitData:
    gen = generator(device, seed)
    return Lion8bitData(randn_list(shapes, gen), randn_list(shapes, gen), randn_list(shapes, gen, 0.1))


def _rule():
    from mtapply.rules import library

    return library.lion().with_state_bits(8)


def quantized_state(data: Lion8bitData) -> tuple:
    """The rule's 8-bit state (codes, scales) holding the data's moments."""
    import torch

    from mtapply import quantization

    codes, scales = _rule().state(data.params)
    for k, m in enumerate(data.exp_avgs):
        if codes[k].dtype == torch.float32:
            codes[k].copy_(m)
            continue
        c, s = quantization.quantize_blockwise(m.cpu().numpy(), True)
        codes[k].copy_(torch.from_numpy(c).reshape(codes[k].shape))
        scales[k].copy_(torch.from_numpy(s))
    return codes, scales


def _state_note(state, params) -> str:
    numel = sum(p.numel() for p in params)
    nbytes = sum(x.numel() * x.element_size() for column in state for x in column)
    return f"state {nbytes / max(numel, 1):.3f} B/param"


def mtapply_8bit(data: Lion8bitData) -> Stepper:
    state = quantized_state(data)
    plan = _rule().plan(data.params, data.grads, *state)

    def step():
        plan.step(lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WEIGHT_DECAY)

    return Stepper(step, plan, state, data, note=_state_note(state, data.params))


def mtapply_fp32(data: Lion8bitData) -> Stepper:
    from mtapply.rules import library

    plan = library.lion().plan(*data.lists())

    def step():
        plan.step(lr=LR, beta1=BETA1, beta2=BETA2, weight_decay=WEIGHT_DECAY)

    return Stepper(step, plan, data, moves=FP32_BYTES, note="fp32 exp_avg, 4 B/param")



def mtapply_torch(data: Lion8bitData) -> Stepper:
    import mtapply.torch as mt

    codes, scales = quantized_state(data)
    opt = mt.Lion(params_with_grads(data), lr=LR, betas=(BETA1, BETA2),
                  weight_decay=WEIGHT_DECAY, state_bits=8)
    for p, m, s in zip(data.params, codes, scales):  # the data's moments, as the plan row's
        opt.state[p].update(exp_avg=m, exp_avg_absmax=s)
    return Stepper(opt.step, opt, data)


def bitsandbytes(data: Lion8bitData) -> Stepper:
    import bitsandbytes as bnb

    opt = bnb.optim.Lion8bit(params_with_grads(data), lr=LR, betas=(BETA1, BETA2),
                             weight_decay=WEIGHT_DECAY)
    opt.step()  # creates the state (zero moments, quantized its way)
    return Stepper(opt.step, opt, data)


COMPETITORS = {
    "mtapply": Competitor(mtapply_8bit, "mtapply.rules.library.lion().with_state_bits(8).plan"),
    "mtapply-torch": Competitor(mtapply_torch, "mtapply.torch.Lion(..., state_bits=8).step()"),
    "mtapply-fp32": Competitor(mtapply_fp32, "the fp32 Lion rule's plan"),
    "bnb-lion8bit": Competitor(bitsandbytes, "bitsandbytes.optim.Lion8bit"),
}
