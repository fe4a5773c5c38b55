"""Rules whose state slots are kept in 8 bits (`Rule.with_state_bits`): the rule's functor on the
8-bit walk (kernels/quantized.cuh), and its NumPy path between dequantizing and quantizing.

The format is `mtapply.quantization`'s (blockwise dynamic maps, one float32 absmax per block of
256 elements), the one `mtapply.adam8bit_step` keeps. A param's 8-bit slots are either all uint8
codes (shaped as the param, each with a list of ceil(numel / 256) scales named `<slot>_absmax`)
or all float32 with empty scales: small params keep float32 state and form their own launch
group, which runs the rule as it is.
"""
from __future__ import annotations

import numpy as np

from .. import _calls, _source, quantization
from ..plan import Plan
from ..ops.adam8bit import QUANTIZED_CHUNK, check_eight_bit, dynamic_maps_source
from . import _factored_cuda
from ._spec import RuleSpec, list_name


def scale_name(slot: str) -> str:
    """The list of block scales of an 8-bit slot: exp_avg -> exp_avg_absmax."""
    return f"{slot}_absmax"


class QuantizedRuleSpec(RuleSpec):
    """A rule as an op whose slots `eight_bit` (state slot names) are 8-bit codes, those in
    `unsigned` on the unsigned map (values >= 0: a second moment), the others on the signed."""

    def __init__(self, name: str, program, eight_bit: tuple, unsigned: tuple,
                 stochastic_rounding: bool = False):
        # (a first pass, which sums, stores nothing: the update computes every slot itself
        # from the same codes)
        super().__init__(name, program, stochastic_rounding=stochastic_rounding, store_first=False)
        names = [s.name for s in program.slots]
        # in slot order: the kernel finds the k-th 8-bit slot's scales in the k-th scale list
        self.eight_bit = tuple(sorted(eight_bit, key=names.index))
        self.unsigned = tuple(unsigned)
        self.scale_slots = tuple(scale_name(s) for s in self.eight_bit)
        self.slots = self.slots + self.scale_slots
        self.written = self.written | set(self.scale_slots)
        self.slot_formats = {**self.slot_formats, **{list_name(s): (("uint8", "float32"), True) for s in self.eight_bit},
                             **{s: (("float32",), False) for s in self.scale_slots}}
        mask = sum(1 << names.index(s) for s in self.eight_bit)
        unsigned_mask = sum(1 << names.index(s) for s in self.unsigned)
        # each element pass's functor (mta::Rule_<digest>Sums, mta::Rule_<digest>) on the 8-bit
        # walk; a factored rule's reductions first, as they are (they read no 8-bit slot:
        # refuse_cuda)
        suffix = f"_q{mask}u{unsigned_mask}"
        self.name = f"{self.name}:8bit:{mask}:{unsigned_mask}"
        self._plain_file = self.kernel_file
        self.kernel_file = f"{self.functor.split('::')[1].lower()}{suffix}.cuh"
        reductions = len(_factored_cuda.reduction_names(program)) if program.factored else 0
        elements = self.functors[reductions:]
        _source.register_generated("dynamic_maps.cuh", dynamic_maps_source())
        _source.register_generated(self.kernel_file, "\n".join([
            f'#include "{self._plain_file}"', '#include "quantized.cuh"', "namespace mta {",
            *(f"struct {plain.split('::')[1]}{suffix} : Quantized<{plain}, {mask}u, "
              f"{unsigned_mask}u> {{}};" for plain in elements),
            "}  // namespace mta", ""]))
        self._quantized_functors = (self.functors[:reductions]
                                    + tuple(f"{plain}{suffix}" for plain in elements))
        self.eight_bit_slots = tuple((list_name(s), scale_name(s), s not in self.unsigned)
                                     for s in self.eight_bit)

    def refuse_cuda(self) -> None:
        """Also refuses 8-bit slots that a factored rule's row and column means read: the
        factor pass sums each element's terms from the slots as stored, without the 8-bit
        walk's scales."""
        super().refuse_cuda()
        if not self.program.factored:
            return
        summed = sorted(_factored_cuda.factor_reads(self.program) & set(self.eight_bit))
        if summed:
            raise NotImplementedError(
                f"rule {self.rule_name!r}: the 8-bit slot {summed[0]!r} is read by the row and "
                f"column means, which on a GPU sum the slots as stored (not dequantized): keep "
                f"it in float32 (with_state_bits(8, slots=...) without it) or step these "
                f"tensors on the CPU")

    def _quantized(self, dtypes: tuple) -> bool:
        return dtypes[self.slots.index(list_name(self.eight_bit[0]))] == "uint8"

    def walks_itself(self, dtypes: tuple) -> bool:
        return self._quantized(dtypes)

    def functors_for(self, dtypes: tuple) -> tuple:
        return self._quantized_functors if self._quantized(dtypes) else self.functors

    def chunk_for(self, dtypes: tuple) -> int:
        return QUANTIZED_CHUNK if self._quantized(dtypes) else super().chunk_for(dtypes)

    def compile_options(self, dtypes: tuple) -> tuple:
        # the codes' error is some ten thousand times that of an ulp of division or square root
        return (_source.APPROXIMATE_OPTIONS if self._quantized(dtypes)
                else super().compile_options(dtypes))

    def check_tensors(self, refs: dict) -> None:
        super().check_tensors(refs)
        states = [list_name(s) for s in self.eight_bit]
        for i, param in enumerate(refs["params"]):
            kinds = {refs[name][i].dtype for name in states}
            if len(kinds) > 1:
                raise TypeError(f"{', '.join(f'{n}[{i}]' for n in states)} are of "
                                f"{' and '.join(sorted(kinds))}: a param's 8-bit slots are all "
                                f"uint8 codes or all float32")
            check_eight_bit(i, param, refs["grads"][i], kinds == {"uint8"},
                            [(name, refs[name][i]) for name in self.scale_slots], "state",
                            "the rule's state(params)")

    def cpu_in_place(self, args: dict, dtype):
        return None  # 8-bit slots are dequantized and quantized around the rule's update

    def cpu_eight_bit_in_place(self, args: dict, dtype):
        """The rule's update in place (`RuleSpec.cpu_in_place`) on dequantized 8-bit slots."""
        return super().cpu_in_place(args, dtype)

    def _dequantized(self, arrays: dict) -> dict:
        """The arrays with each 8-bit slot's values in float32, as the kernel reads them (float32
        state as it is)."""
        if arrays[self.scale_slots[0]].size == 0:
            return arrays
        shape = arrays["params"].shape
        values = dict(arrays)
        for slot, scale in zip(self.eight_bit, self.scale_slots):
            codes = np.asarray(arrays[list_name(slot)]).astype(np.uint8)
            values[list_name(slot)] = quantization.dequantize_blockwise(
                codes, arrays[scale], signed=slot not in self.unsigned).reshape(shape)
        return values

    def cpu_sums(self, index: int, arrays: dict, args: dict, dtype) -> list:
        return super().cpu_sums(index, self._dequantized(arrays), args, dtype)

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        if arrays[self.scale_slots[0]].size == 0:  # float32 state: the rule as it is
            return super().cpu_update(arrays, args, dtype, index)
        shape = arrays["params"].shape
        new = super().cpu_update(self._dequantized(arrays), args, dtype, index)
        for slot, scale in zip(self.eight_bit, self.scale_slots):
            if list_name(slot) in new:
                codes, absmax = quantization.quantize_blockwise(
                    new[list_name(slot)], signed=slot not in self.unsigned)
                new[list_name(slot)], new[scale] = codes.reshape(shape), absmax
        return new


class QuantizedRule:
    """A rule whose state slots `eight_bit` are kept in 8 bits (see `Rule.with_state_bits`):
    `step` and `plan` take the rule's lists, then one list of block scales per 8-bit slot;
    `state(params)` makes every state list."""

    def __init__(self, rule, eight_bit: tuple, unsigned: tuple, threshold: int):
        self.rule, self.eight_bit, self.unsigned = rule, tuple(eight_bit), tuple(unsigned)
        self.threshold = threshold
        self.name = rule.name
        self._specs: dict = {}  # by stochastic_rounding

    @property
    def slots(self) -> tuple:
        """The lists `step` and `plan` take: the rule's slots, then each 8-bit slot's scales."""
        return self.rule.slots + tuple(scale_name(s) for s in self.eight_bit)

    @property
    def hyper(self) -> dict:
        return self.rule.hyper

    @property
    def program(self):
        return self.rule.program

    @property
    def initial(self) -> dict:
        return self.rule.initial

    @property
    def scalars(self) -> dict:
        return self.rule.scalars

    def initial_scalars(self, dtype="float32"):
        return self.rule.initial_scalars(dtype)

    def spec(self, master_weights: bool = False,
             stochastic_rounding: bool = False) -> QuantizedRuleSpec:
        if master_weights:
            raise ValueError(f"rule {self.name!r} with 8-bit state steps float32 or 16-bit params "
                             f"in place: master_params are not taken")
        spec = self._specs.get(bool(stochastic_rounding))
        if spec is None:
            spec = self._specs[bool(stochastic_rounding)] = QuantizedRuleSpec(
                self.name, self.rule.program, self.eight_bit, self.unsigned,
                stochastic_rounding=stochastic_rounding)
        return spec

    def plan(self, *lists, stochastic_rounding=False, table_mode=None, stream=None):
        """Binds the lists (in `slots` order) once; `plan.step(**hyper)` then steps them
        (`stochastic_rounding` as `Rule.plan` has it)."""
        spec = self.spec(stochastic_rounding=stochastic_rounding)
        return Plan(spec, self._tensors(spec, lists), table_mode=table_mode, stream=stream)

    def step(self, *lists, stochastic_rounding=False, grad_scale=None, found_inf=None,
             stream=None, table_mode=None, **hyper) -> None:
        """One step over whole lists (in `slots` order), in place (a hyperparameter may be one
        value per tensor, as in `Rule.step`)."""
        spec = self.spec(stochastic_rounding=stochastic_rounding)
        spec.check_arguments(len(lists[0]) if lists else 0, **hyper)
        _calls.step(spec, self._tensors(spec, lists), table_mode=table_mode, stream=stream,
                    grad_scale=grad_scale, found_inf=found_inf, **hyper)

    def _tensors(self, spec, lists: tuple) -> dict:
        if len(lists) != len(spec.slots):
            raise TypeError(f"rule {self.name!r} with 8-bit state takes {len(spec.slots)} lists "
                            f"({', '.join(self.slots)}), got {len(lists)}")
        return dict(zip(spec.slots, lists))

    def state(self, params, min_dim_size: int = 1) -> tuple:
        """The state lists for `params` (torch tensors, CuPy or NumPy arrays; in their
        framework, on their devices), in `slots` order after param and grad: each state slot
        at its declared first value (`Rule.initial`), as 8-bit codes for params of at least
        `threshold` elements (float32 below), then the scales of each 8-bit slot. A factored
        rule's slots take their shapes from `Rule.state_shapes(param.shape, min_dim_size)`."""
        states = [s for s in self.rule.slots if s not in ("param", "grad")]
        columns = {name: [] for name in states + [scale_name(s) for s in self.eight_bit]}
        for i, param in enumerate(params):
            host = None
            quantized = _numel(param) >= self.threshold
            shapes = self.rule.state_shapes(tuple(param.shape), min_dim_size)
            for slot in states:
                first = self.rule.initial[slot]
                if first == "param" and host is None:
                    host = _host_values(param)
                if first == "param" and shapes[slot] != tuple(param.shape):
                    raise ValueError(f"rule {self.name!r}: slot {slot!r} starts as the param but "
                                     f"is shaped {shapes[slot]} beside params[{i}] "
                                     f"{tuple(param.shape)}: start it at a number")
                values = host if first == "param" else np.full(shapes[slot], first, np.float32)
                if slot in self.eight_bit and quantized:
                    codes, absmax = quantization.quantize_blockwise(values, signed=slot not in
                                                                    self.unsigned)
                    columns[slot].append(_like(param, codes.reshape(values.shape), f"params[{i}]"))
                    columns[scale_name(slot)].append(_like(param, absmax, f"params[{i}]"))
                else:
                    dtype = np.float32 if slot in self.eight_bit else _float_dtype(param)
                    columns[slot].append(_like(param, np.array(values, dtype), f"params[{i}]"))
                    if slot in self.eight_bit:
                        columns[scale_name(slot)].append(
                            _like(param, np.zeros(0, np.float32), f"params[{i}]"))
        return tuple(columns.values())

    def __repr__(self) -> str:
        unsigned = f", unsigned={self.unsigned!r}" if self.unsigned else ""
        return f"{self.rule!r}.with_state_bits(8, slots={self.eight_bit!r}{unsigned})"

    def __reduce__(self):
        return _remake, (self.rule, self.eight_bit, self.unsigned, self.threshold)


def _remake(rule, eight_bit, unsigned, threshold):
    return QuantizedRule(rule, eight_bit, unsigned, threshold)


def _numel(x) -> int:
    n = 1
    for d in x.shape:
        n *= int(d)
    return n


def _host_values(param) -> np.ndarray:
    """The param's values as a float32 NumPy array (a copy to the host, once, at state making)."""
    if hasattr(param, "detach"):  # torch
        return param.detach().float().cpu().numpy()
    if hasattr(param, "get"):  # CuPy
        return np.asarray(param.get(), np.float32)
    return np.asarray(param, np.float32)


def _float_dtype(param):
    """The NumPy dtype of a float32 state slot kept beside a param (its own float dtype)."""
    name = str(param.dtype).replace("torch.", "")
    return np.float64 if name == "float64" else np.float32


def _like(param, values: np.ndarray, where: str):
    """`values` in the param's framework, on its device."""
    module = type(param).__module__.split(".")[0]
    if module == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(values)).to(param.device)
    if module == "cupy":
        import cupy

        with param.device:
            return cupy.asarray(values)
    if isinstance(param, np.ndarray):
        return values.copy()
    raise TypeError(f"{where} is a {type(param).__name__}: state() makes torch, CuPy or NumPy "
                    f"state; for other frameworks make uint8 codes and float32 scales as "
                    f"`mtapply.quantization` lays them out")
