"""Benchmark workloads: each is a list of parameter shapes, stored in fp32 unless it says otherwise.

`WORKLOADS` maps a name to a function returning the shapes. A new workload adds its function here
and its expected tensor and parameter counts to `EXPECTED` (so a wrong shape list fails loudly
instead of producing a plausible-looking benchmark); a workload that is not all fp32 adds its
`Dtypes` to `WORKLOAD_DTYPES`, and only ops that list those dtypes run it. Targets belong to each
op's module. Needs only NumPy, so `--list` works without torch or a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# name -> (number of tensors, number of parameters)
EXPECTED = {
    "big256M": (1, 268_435_456),
    "gpt2-124M": (148, 124_439_808),
    "gpt2-bf16": (148, 124_439_808),
    "small10k": (10_000, 21_762_580),
    "tiny2k": (2_000, 200_000),
    "resnet50": (161, 25_557_032),
    "resnet152": (467, 60_192_808),
    "gpt2-hidden": (48, 84_934_656),
    "gpt2-hidden72": (72, 84_934_656),
    "matrices400": (400, 328_499_200),
    "t5-base": (257, 222_903_552),
}

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per element, by torch dtype name


@dataclass(frozen=True)
class Dtypes:
    """What a workload's tensors are stored in (torch dtype names): params, grads, optimizer
    states, and the master weights kept beside low-precision params (None: no master copy;
    an op that offers none updates the params themselves)."""

    params: str = "float32"
    grads: str = "float32"
    states: str = "float32"
    master: str | None = None

    def text(self) -> str:
        if self == FP32:
            return "fp32"
        master = f", {_short(self.master)} master weights" if self.master else ""
        return (f"{_short(self.params)} params, {_short(self.grads)} grads, "
                f"{_short(self.states)} states{master}")


FP32 = Dtypes()
BF16_MASTER = Dtypes(params="bfloat16", grads="bfloat16", states="float32", master="float32")
WORKLOAD_DTYPES = {"gpt2-bf16": BF16_MASTER}  # every other workload is all fp32


def big256m() -> list:
    """One tensor of 2**28 elements (1 GiB in fp32): pure streaming bandwidth."""
    return _checked("big256M", [(2**28,)])


def gpt2_124m() -> list:
    """GPT-2 small in `model.parameters()` order: embeddings, 12 blocks, final layer norm."""
    d_model, vocab, context, layers = 768, 50257, 1024, 12
    block = [
        (d_model,), (d_model,),                      # ln_1 weight, bias
        (d_model, 3 * d_model), (3 * d_model,),      # attn.c_attn weight, bias
        (d_model, d_model), (d_model,),              # attn.c_proj weight, bias
        (d_model,), (d_model,),                      # ln_2 weight, bias
        (d_model, 4 * d_model), (4 * d_model,),      # mlp.c_fc weight, bias
        (4 * d_model, d_model), (d_model,),          # mlp.c_proj weight, bias
    ]
    shapes = [(vocab, d_model), (context, d_model)] + block * layers + [(d_model,), (d_model,)]
    return _checked("gpt2-124M", shapes)


def gpt2_bf16() -> list:
    """GPT-2 small's shapes again, for mixed precision (dtypes in `WORKLOAD_DTYPES`)."""
    return _checked("gpt2-bf16", gpt2_124m())


def gpt2_hidden() -> list:
    """GPT-2 small's hidden matrices, those Muon steps: 12 blocks of c_attn, attn.c_proj,
    mlp.c_fc and mlp.c_proj weights (4 shapes)."""
    d_model = 768
    block = [(d_model, 3 * d_model), (d_model, d_model), (d_model, 4 * d_model),
             (4 * d_model, d_model)]
    return _checked("gpt2-hidden", block * 12)


def gpt2_hidden72() -> list:
    """The same matrices with the attention's query, key and value as three square weights, as
    modded-nanogpt lays GPT-2 small out: 12 blocks of c_q, c_k, c_v, c_proj (768 x 768), mlp.c_fc
    (3072 x 768) and mlp.c_proj (768 x 3072), nn.Linear's (out, in) layout: 72 matrices, 3 shapes,
    as many params as gpt2-hidden."""
    d_model = 768
    block = [(d_model, d_model)] * 4 + [(4 * d_model, d_model), (d_model, 4 * d_model)]
    return _checked("gpt2-hidden72", block * 12)


def matrices400() -> list:
    """400 matrices of 10 shapes, 64x64 to 1024x4096 (square, wide and tall), 40 of each."""
    shapes = [(64, 64), (128, 128), (256, 256), (512, 512), (1024, 1024), (256, 1024),
              (1024, 256), (512, 2048), (2048, 512), (1024, 4096)]
    return _checked("matrices400", shapes * 40)


def t5_base() -> list:
    """T5-base (HF T5ForConditionalGeneration) in `model.parameters()` order, written out from
    the architecture: the shared embedding (the LM head is tied to it), 12 encoder blocks
    (self-attention, feed-forward), 12 decoder blocks (self-attention, cross-attention,
    feed-forward), each stack's final layer norm. Linear weights are (out, in), layer norms
    have no bias, and each stack's first block holds its relative attention bias (32 buckets x
    12 heads)."""
    d_model, d_ff, vocab, buckets, heads = 768, 3072, 32128, 32, 12
    attention = [(d_model, d_model)] * 4  # q, k, v, o
    feed_forward = [(d_ff, d_model), (d_model, d_ff), (d_model,)]  # wi, wo, layer norm
    encoder_block = attention + [(d_model,)] + feed_forward
    decoder_block = attention + [(d_model,)] + attention + [(d_model,)] + feed_forward
    bias = [(buckets, heads)]
    encoder = attention + bias + encoder_block[4:] + encoder_block * 11 + [(d_model,)]
    decoder = attention + bias + decoder_block[4:] + decoder_block * 11 + [(d_model,)]
    return _checked("t5-base", [(vocab, d_model)] + encoder + decoder)


def small10k() -> list:
    """10,000 small 1-D tensors of 256..4096 elements: many blocks' worth of ragged work."""
    sizes = np.random.default_rng(0).integers(256, 4097, size=10_000)
    return _checked("small10k", [(int(size),) for size in sizes])


def tiny2k() -> list:
    """2,000 tensors of 100 elements: launch- and host-bound, no meaningful byte floor."""
    return _checked("tiny2k", [(100,)] * 2_000)


def resnet50() -> list:
    """torchvision.models.resnet50()'s parameters in `model.parameters()` order, written out from
    the architecture (torchvision is not always installed): a 7x7 stem, four stages of bottleneck
    blocks, then the classifier. Convolutions have no bias; each is followed by a batch norm
    (weight, bias)."""
    return _checked("resnet50", _resnet((3, 4, 6, 3)))


def resnet152() -> list:
    """torchvision.models.resnet152()'s parameters, as `resnet50`: stages of 3, 8, 36 and 3
    blocks, 467 tensors (a long list of mostly small batch-norm tensors)."""
    return _checked("resnet152", _resnet((3, 8, 36, 3)))


def _resnet(stages: tuple) -> list:
    shapes = [(64, 3, 7, 7), (64,), (64,)]  # conv1, bn1
    in_channels = 64
    for blocks, width in zip(stages, (64, 128, 256, 512)):
        for block in range(blocks):
            shapes += _bottleneck(in_channels, width, downsample=block == 0)
            in_channels = 4 * width  # bottleneck expansion
    return shapes + [(1000, in_channels), (1000,)]  # fc weight, bias


def _bottleneck(in_channels: int, width: int, downsample: bool) -> list:
    """One bottleneck block: conv1 1x1, conv2 3x3, conv3 1x1 (each with its batch norm), and on
    a stage's first block the 1x1 downsample convolution and its batch norm."""
    out_channels = 4 * width
    shapes = [(width, in_channels, 1, 1), (width,), (width,),
              (width, width, 3, 3), (width,), (width,),
              (out_channels, width, 1, 1), (out_channels,), (out_channels,)]
    if downsample:
        shapes += [(out_channels, in_channels, 1, 1), (out_channels,), (out_channels,)]
    return shapes


WORKLOADS = {
    "big256M": big256m,
    "gpt2-124M": gpt2_124m,
    "gpt2-bf16": gpt2_bf16,
    "small10k": small10k,
    "tiny2k": tiny2k,
    "resnet50": resnet50,
    "resnet152": resnet152,
    "gpt2-hidden": gpt2_hidden,
    "gpt2-hidden72": gpt2_hidden72,
    "matrices400": matrices400,
    "t5-base": t5_base,
}


def dtypes(name: str) -> Dtypes:
    return WORKLOAD_DTYPES.get(name, FP32)


def count_params(shapes) -> int:
    return sum(math.prod(shape) for shape in shapes)


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype)


def _checked(name: str, shapes: list) -> list:
    """`shapes`, after checking them against `EXPECTED[name]` (raises even under python -O)."""
    counts = (len(shapes), count_params(shapes))
    if counts != EXPECTED[name]:
        raise AssertionError(f"workload {name} has {counts[0]} tensors and {counts[1]} params, "
                             f"expected {EXPECTED[name][0]} and {EXPECTED[name][1]}")
    return shapes
