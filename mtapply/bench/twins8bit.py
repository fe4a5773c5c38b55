"""The 8-bit optimizers bitsandbytes ships one class each for (RMSprop8bit, Adagrad8bit, SGD8bit
with momentum, AdEMAMix8bit), against mtapply.torch's same optimizer with `state_bits=8`, one
launch for the list, and with float32 state: an op each (`rmsprop8bit`, ...), fp32 params and
grads, every state slot in 8 bits (params under 4096 elements keep float32 state in both)."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

from .adam8bit import _optimizer_state_bytes, _peer, state_note
from .common import Competitor, Stepper, TensorLists, generator, params_with_grads, randn_list


@dataclass(frozen=True)
class Twin:
    op: str           # the op's name
    optimizer: str    # mtapply.torch's class, which torch.optim names the same
    bnb: str          # bitsandbytes.optim's 8-bit class
    options: dict     # the arguments both take
    slots: int        # state slots per param, each a byte per element in 8 bits


TWINS = (
    Twin("rmsprop8bit", "RMSprop", "RMSprop8bit", dict(lr=1e-3, alpha=0.99, eps=1e-8), 1),
    Twin("adagrad8bit", "Adagrad", "Adagrad8bit", dict(lr=1e-2, eps=1e-10), 1),
    Twin("sgd8bit", "SGD", "SGD8bit", dict(lr=1e-2, momentum=0.9), 1),
    Twin("ademamix8bit", "AdEMAMix", "AdEMAMix8bit", dict(lr=1e-3, weight_decay=0.01), 3),
)


@dataclass
class Data(TensorLists):
    params: list
    grads: list


def make_data(shapes, device, seed: int = 0) -> Data:
    gen = generator(device, seed)
    return Data(randn_list(shapes, gen), randn_list(shapes, gen, 0.1))


def _mtapply(twin: Twin, state_bits: int):
    def build(data: Data) -> Stepper:
        import mtapply.torch as mt

        opt = getattr(mt, twin.optimizer)(params_with_grads(data), state_bits=state_bits,
                                          **twin.options)
        opt.step()  # creates the state
        moves = None if state_bits == 8 else 12 + 8 * twin.slots
        note = state_note(_optimizer_state_bytes(opt), data.params)
        return Stepper(opt.step, opt, data, moves=moves, note=note)
    return build


def _bitsandbytes(twin: Twin):
    def make(params):
        import bitsandbytes as bnb

        return getattr(bnb.optim, twin.bnb)(params, **twin.options)
    return _peer(make)


def _op(twin: Twin) -> SimpleNamespace:
    """The bench op of `twin` (the names mtapply.bench.ops documents)."""
    return SimpleNamespace(
        NAME=twin.op,
        DESCRIPTION=(f"{twin.optimizer.lower()} with {twin.slots} 8-bit state slot"
                     f"{'s' if twin.slots > 1 else ''}, fp32 params and grads, "
                     f"{', '.join(f'{k}={v}' for k, v in twin.options.items())}; state of params "
                     f"under 4096 elements stays fp32"),
        # read p, g and the codes, write p and the codes (+ 8 bytes of scales per slot and 256)
        BYTES_PER_PARAM=12 + 2 * twin.slots,
        REFERENCE="mtapply-fp32",
        DEFAULT_WORKLOADS=("gpt2-124M",),
        TARGETS={"gpt2-124M": ("x_floor", 1.1)},
        make_data=make_data,
        COMPETITORS={
            "mtapply": Competitor(_mtapply(twin, 8),
                                        f"mtapply.torch.{twin.optimizer}(..., state_bits=8).step()"),
            "mtapply-fp32": Competitor(_mtapply(twin, 32),
                                       f"mtapply.torch.{twin.optimizer}(...), float32 state"),
            f"bnb-{twin.op}": Competitor(_bitsandbytes(twin), f"bitsandbytes.optim.{twin.bnb}"),
        })


OPS = tuple(_op(twin) for twin in TWINS)
