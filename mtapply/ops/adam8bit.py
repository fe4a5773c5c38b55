"""Adam/AdamW with 8-bit blockwise-quantized moments (`mtapply.quantization`'s format)."""
from __future__ import annotations

import numpy as np

from .. import _source, quantization, reference
from .adam import AdamSpec

MOMENTS = ("exp_avgs", "exp_avg_sqs")
PARAM_DTYPES = ("float32", "bfloat16", "float16")  # with 8-bit moments
SCALES = ("exp_avg_absmax", "exp_avg_sq_absmax")
# elements per CUDA block of the 8-bit kernel: each block first loads the maps into shared
# memory, so it takes many quantization blocks (16 per warp) to amortise that; longer chunks
# leave SMs idle in the last wave (H200, gpt2-124M: 0.513 ms per step at 32,768, 0.531 at 65,536)
QUANTIZED_CHUNK = 32768


def dynamic_maps_source() -> str:
    """The CUDA constants of both dynamic maps: their values, as exact hex literals, and the code
    tables that find the nearest code (`quantization.code_words`), so that the kernel rounds to
    the very codes the NumPy format gives."""
    lines = ["namespace mta {", f"constexpr unsigned CELL_LOW = {quantization.CELL_LOW:#x};",
             f"constexpr int CODE_CELLS = {quantization.CELLS};",
             f"constexpr float CELL_FLOOR = {float(quantization.CELL_FLOOR).hex()}f;"]
    for signed, prefix in ((True, "SIGNED"), (False, "UNSIGNED")):
        values = ", ".join(f"{float(x).hex()}f" for x in quantization.dynamic_map(signed))
        lines.append(f"__device__ __align__(16) const float {prefix}_MAP[256] = {{{values}}};")
    # the signed map's words for both signs, then the unsigned map's, padded to 16-byte words
    words = np.concatenate([quantization.code_words(True), quantization.code_words(False)])
    words = np.append(words, np.zeros(-words.size % 4, np.uint32))
    lines.append(f"__device__ __align__(16) const unsigned CODE_WORDS[{words.size}] = "
                 f"{{{', '.join(f'{int(w):#x}u' for w in words)}}};")
    return "\n".join(lines + ["}  // namespace mta"]) + "\n"


def check_eight_bit(i: int, param, grad, quantized: bool, scales, what: str, maker: str) -> None:
    """The checks of the i-th tensor of an 8-bit step: params and grads 8-bit states take, and
    each (name, scale ref) in `scales` holding one float32 per block (none for float32 state)."""
    if quantized and (param.dtype not in PARAM_DTYPES or grad.dtype not in (param.dtype, "float32")):
        raise TypeError(f"params[{i}] and grads[{i}] are {param.dtype} and {grad.dtype}: 8-bit "
                        f"{what} take params of {', '.join(PARAM_DTYPES)}, with grads of the "
                        f"param's dtype or float32")
    blocks = quantization.n_blocks(param.numel) if quantized else 0
    for name, scale in scales:
        if scale.numel != blocks or (scale.numel > 1 and not scale.row_major):
            size = (f"{blocks} elements (ceil({param.numel} / {quantization.BLOCK})) for uint8 "
                    f"{what}" if quantized else f"0 elements for float32 {what}")
            raise ValueError(f"{name}[{i}] has shape {scale.shape}, but it must be a contiguous "
                             f"float32 array of {size}; {maker} makes them")


class Adam8bitSpec(AdamSpec):
    """Adam/AdamW (AdamSpec's update and arguments) on moments kept as 8-bit codes with one
    float32 scale (absmax) per block of `quantization.BLOCK` elements: each step dequantizes a
    block, updates it in fp32 and quantizes it again with its fresh absmax.

    A param's moments are either both uint8 codes (shaped as the param, with scales of
    ceil(numel / BLOCK) elements) or both float32 (with empty scales): small tensors keep fp32
    moments and form their own launch group.
    """

    name = "adam8bit"
    kernel_file = "adam8bit.cuh"
    functor = "mta::Adam"
    slot_formats = {"exp_avgs": (("uint8", "float32"), True),
                    "exp_avg_sqs": (("uint8", "float32"), True),
                    "exp_avg_absmax": (("float32",), False),
                    "exp_avg_sq_absmax": (("float32",), False)}

    def __init__(self, *, decoupled_weight_decay: bool = False, maximize: bool = False,
                 stochastic_rounding: bool = False):
        super().__init__(decoupled_weight_decay=decoupled_weight_decay, maximize=maximize,
                         stochastic_rounding=stochastic_rounding)
        self.slots = self.slots + SCALES
        self.written = self.written | set(SCALES)
        _source.register_generated("dynamic_maps.cuh", dynamic_maps_source())

    def functors_for(self, dtypes: tuple) -> tuple:
        return ("mta::Adam8bit",) if dtypes[2] == "uint8" else ("mta::Adam",)

    def chunk_for(self, dtypes: tuple) -> int:
        return QUANTIZED_CHUNK if dtypes[2] == "uint8" else super().chunk_for(dtypes)

    def walks_itself(self, dtypes: tuple) -> bool:
        return dtypes[2] == "uint8"

    def compile_options(self, dtypes: tuple) -> tuple:
        # a division or square root off by an ulp or two moves a code only where the value
        # lies on a midpoint; the error of the 8-bit codes is some ten thousand times larger
        return (_source.APPROXIMATE_OPTIONS if dtypes[2] == "uint8"
                else super().compile_options(dtypes))

    def check_tensors(self, refs: dict) -> None:
        super().check_tensors(refs)
        columns = zip(refs["params"], refs["grads"], *(refs[name] for name in MOMENTS + SCALES))
        for i, (param, grad, m, v, m_scale, v_scale) in enumerate(columns):
            if m.dtype != v.dtype:
                raise TypeError(f"exp_avgs[{i}] is {m.dtype} but exp_avg_sqs[{i}] is {v.dtype}: "
                                f"a param's moments are both uint8 codes or both float32")
            check_eight_bit(i, param, grad, m.dtype == "uint8",
                            ((SCALES[0], m_scale), (SCALES[1], v_scale)), "moments",
                            "mtapply.adam8bit_state")

    eight_bit_slots = (("exp_avgs", "exp_avg_absmax", True),
                       ("exp_avg_sqs", "exp_avg_sq_absmax", False))

    def cpu_eight_bit_in_place(self, args: dict, dtype):
        """`cpu_update`'s step of 8-bit moments on dequantized values, in place
        (`reference.adam_into`)."""
        if not self.cpu_batchable():
            return None
        options = self._cpu_options(args, dtype)

        def update(arrays: tuple, dests: tuple, scratch: list) -> None:
            reference.adam_into(*arrays, dests, scratch, **options)

        update.n_buffers = 3
        update.adam = options  # what the native step (mtapply._cpu_eight_bit) takes instead
        return update

    def _cpu_options(self, args: dict, dtype) -> dict:
        return dict(lr=args["lr"], step=args["step"], beta1=args["beta1"], beta2=args["beta2"],
                    eps=args["eps"], weight_decay=args["weight_decay"],
                    decoupled_weight_decay=self.decoupled_weight_decay, maximize=self.maximize,
                    dtype=dtype)

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        options = self._cpu_options(args, dtype)
        p, g = arrays["params"], arrays["grads"]
        if arrays["exp_avg_absmax"].size == 0:  # float32 moments
            p, m, v, _ = reference.adam(p, g, arrays["exp_avgs"], arrays["exp_avg_sqs"], **options)
            return {"params": p, "exp_avgs": m, "exp_avg_sqs": v}
        codes = [(arrays[m].astype(np.uint8), arrays[s]) for m, s in zip(MOMENTS, SCALES)]
        p, (m, m_scale), (v, v_scale) = reference.adam8bit(p, g, *codes, **options)
        return {"params": p, "exp_avgs": m, "exp_avg_sqs": v, "exp_avg_absmax": m_scale,
                "exp_avg_sq_absmax": v_scale}


__all__ = ["Adam8bitSpec", "MOMENTS", "SCALES", "check_eight_bit"]
