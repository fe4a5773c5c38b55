"""What every op spec provides to the engine."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from .. import _source
from .._launch import HEADER_BYTES
from .._ranges import ANY, RANGES, Range, _to_float
from .._rows import rows_for


@dataclass(frozen=True)
class DeviceScalar:
    """A one-element float32 device array read by the kernel at run time (lr, step, ...)."""

    ptr: int
    obj: object  # keeps the memory alive
    checked: bool = False  # a value mtapply wrote after checking it on the host (its slots)


@dataclass(frozen=True)
class OutputArray:
    """A float32 array (device or host) that an op writes results into (`*_out` arguments)."""

    ptr: int
    obj: object
    ref: object  # its TensorRef, for the CPU backend


class OpSpec:
    """Base of op specs.

    A subclass sets: `name`, `kernel_file`, `functor` (C++ name), `slots` (argument names in
    kernel slot order), `written` (the slots the op writes), `flags` (compile-time switches),
    `arg_fields` (kernel argument words in order; a `NAME_ptr` word follows NAME and carries the
    address of a DeviceScalar given for NAME; a `NAME_array` word is the address of a per-tensor
    array from `tensor_arrays`)
    and implements `arguments(**hyper)` and `cpu_update(arrays, args, dtype, index)`. An op of
    several passes overrides `functors` and sets `n_sums`.
    """

    name: str
    kernel_file: str
    functor: str
    slots: tuple
    written: frozenset
    flags: tuple
    arg_fields: tuple
    device_scalars: tuple = ()  # the hyperparameters that may be one-element device arrays
    # hyperparameters that change every step (a scheduler's lr, the step count), each checked by
    # `arguments` against an interval of its own whatever the others are: new values of these
    # are patched into per-tensor rows, checked at their extremes
    scheduled: tuple = ("lr", "step")
    n_sums: int = 0  # per-tensor sums a pass accumulates for a later one (e.g. LARS norms)
    n_totals: int = 0  # of them, the whole-list sums the plan keeps after them (rules' totals)
    master_weights: bool = False  # a `master_params` slot of fp32 copies of 16-bit params
    # slot -> dtypes it may have, for slots that are not floating tensors shaped as the params
    # (8-bit codes, per-block scales); the op's check_tensors checks their shapes
    slot_formats: dict = {}
    # (codes list, scales list, signed map) of each slot the op may keep in 8 bits
    eight_bit_slots: tuple = ()
    # cpu_update takes each tensor's values shaped as the tensor (else flat): factored rules
    cpu_shaped: bool = False
    single_device: bool = False  # results span the whole list (a global norm): one GPU only
    # whole-list sums or scalar state that the GPUs of a plan share (mtapply._devices.Shared)
    shared: bool = False
    uniform_hyper: bool = False  # one value per hyperparameter for the list (no per-tensor rows)
    ranges: dict = {}  # device scalar -> its Range, where RANGES does not give it (else ANY)

    @property
    def options(self) -> tuple:
        """The compile-time options that are on, by name (a Plan's repr lists them)."""
        return tuple(name.lower() for name, value in self.flags if value is True)

    def _use_master_weights(self, enabled: bool) -> None:
        """Adds the `master_params` slot: the kernel updates the fp32 master (read in place of
        the param) and writes both it and the param rounded to its 16-bit storage."""
        self.master_weights = bool(enabled)
        self.flags = tuple(self.flags) + (("MASTER", self.master_weights),)
        if self.master_weights:
            self.slots = tuple(self.slots) + ("master_params",)
            self.written = self.written | {"master_params"}

    stochastic_rounding: bool = False  # bfloat16 params rounded stochastically (Philox bits)

    def _use_stochastic_rounding(self, enabled: bool) -> None:
        """Adds the STOCHASTIC flag: the kernel stores bfloat16 params rounded stochastically
        (mtapply.stochastic), with random bits keyed by the `seed` argument, the step and the
        tensor's index in the caller's list."""
        self.stochastic_rounding = bool(enabled)
        self.flags = tuple(self.flags) + (("STOCHASTIC", self.stochastic_rounding),)
        if self.stochastic_rounding:
            if self.master_weights:
                raise ValueError("stochastic_rounding rounds the bfloat16 params themselves: "
                                 "pass no master_params with it")
            self.arg_fields = tuple(self.arg_fields) + ("seed_lo", "seed_hi", "sr_tensor_array")

    param_mode: str = "inplace"  # or "delta", "zero": see with_param_mode
    delta_is_step = False  # "delta": the op writes the step itself, not the new param

    def with_param_mode(self, mode: str) -> "OpSpec":
        """A copy of the op that returns updates rather than updating params in place:
        "delta" reads the params and writes new - old into an `updates` slot (added last);
        "zero" takes the params as zeros without reading them (for ops whose update does not
        depend on them), so that what it writes to `params` is the update."""
        if mode not in ("inplace", "delta", "zero"):
            raise ValueError(f"param mode {mode!r}; use inplace, delta or zero")
        if mode != "inplace" and (self.master_weights or self.stochastic_rounding):
            raise ValueError("updates are not taken with master weights or stochastic rounding")
        spec = copy.copy(self)
        spec.param_mode = mode
        if mode == "delta":
            spec.slots = tuple(self.slots) + ("updates",)
            spec.written = (self.written - {"params"}) | {"updates"}
        if mode != "inplace":
            spec.flags = tuple(self.flags) + (({"delta": "DELTA", "zero": "ZERO_PARAM"}[mode], True),)
        return spec

    def check_tensors(self, refs: dict) -> None:
        """Checks that need the ingested tensors (before anything is written)."""
        self.tensor_arrays(len(refs[self.slots[0]]))
        if self.stochastic_rounding:
            for i, param in enumerate(refs["params"]):
                if param.dtype != "bfloat16":
                    raise TypeError(f"params[{i}] is {param.dtype}: stochastic_rounding is for "
                                    f"bfloat16 params (float32 params round exactly enough)")
        if self.master_weights:
            for i, (param, master) in enumerate(zip(refs["params"], refs["master_params"])):
                if master.dtype != "float32":
                    raise TypeError(f"master_params[{i}] is {master.dtype}: master weights are "
                                    f"float32 copies of the params (param.float())")
                if param.dtype not in ("float16", "bfloat16"):
                    raise TypeError(f"params[{i}] is {param.dtype}: master weights are for float16 "
                                    f"or bfloat16 params; pass master_params=None for "
                                    f"{param.dtype} params")

    @property
    def functors(self) -> tuple:
        """C++ functor of each pass, in launch order; most ops have one pass."""
        return (self.functor,)

    def functors_for(self, dtypes: tuple) -> tuple:
        """The functors of a group whose slots have these storage dtypes (an op may run some
        storage formats with other functors, as 8-bit states do)."""
        return self.functors

    def chunk_for(self, dtypes: tuple) -> int:
        """Elements per CUDA block in a group whose slots have these storage dtypes."""
        return _source.CHUNK_ELEMENTS

    def walks_itself(self, dtypes: tuple) -> bool:
        """Whether a group of these slot dtypes runs a functor with its own walk (OWN_WALK:
        8-bit states) rather than the chunk walker."""
        return False

    def threads_for(self, dtypes: tuple, numels, sms: int = 0) -> int:
        """Threads per CUDA block of a group: fewer where all its chunks are small, unless a pass
        sums over the block (block_sum takes whole blocks of BLOCK_THREADS) or the group walks by
        itself (in warps of whole blocks). `sms`: see `_source.block_threads`."""
        if self.n_sums or self.walks_itself(dtypes):
            return _source.BLOCK_THREADS
        return _source.block_threads(numels, self.chunk_for(dtypes), dtypes, sms)

    def compile_options(self, dtypes: tuple) -> tuple:
        """NVRTC options of a group whose slots have these storage dtypes."""
        return _source.COMPILE_OPTIONS

    def tensor_arrays(self, n_tensors: int) -> dict:
        """name -> NumPy array of one value per tensor, for `*_array` kernel arguments."""
        if self.stochastic_rounding:  # each tensor's index in the caller's list
            return {"sr_tensor_array": np.arange(n_tensors, dtype=np.int32)}
        return {}

    def scalar_range(self, name: str) -> Range:
        """What step argument `name` (a device scalar) may hold."""
        return self.ranges.get(name) or RANGES.get(name, ANY)

    def scalar_count(self, name: str) -> int:
        """Float32 values a device value of `name` holds (one; Adam's lr per label: one each)."""
        return 1

    def device_checks(self) -> tuple:
        """The kernel's checks of every device scalar the op reads (`Range.kernel_check`)."""
        return tuple(self.scalar_range(name).kernel_check(
                         self.arg_fields.index(f"{self.field_of(name)}_ptr"),
                         self.scalar_count(name))
                     for name in self.device_scalars
                     if f"{self.field_of(name)}_ptr" in self.arg_fields)

    def sum_dtype(self, param_dtypes) -> str:
        """The dtype of the sums (and scalar state) of a plan whose params have these dtypes:
        float32; a rule's is float64 where every param is float64 (`RuleSpec`)."""
        return "float32"

    def fusable(self, dtypes: tuple) -> bool:
        """Whether a group of these slot dtypes may run its two passes in one launch
        (kernels/walker.cuh, walk_fused): a first pass that only sums over each tensor, and an
        update that reads those sums. No hand-written op does."""
        return False

    def source(self, dtypes: tuple, threads: int = _source.BLOCK_THREADS,
               sum_dtype: str = "float32") -> str:
        """The CUDA source of the op's kernel for a group whose slots have these dtypes,
        launched with `threads` per block (`threads_for`), its sums in `sum_dtype`; with the
        fused entry where `fusable`."""
        flags = self.flags + ((("SUM64", True),) if sum_dtype == "float64" else ())
        return _source.variant_source(self.kernel_file, self.functors_for(dtypes), dtypes,
                                      flags, self.chunk_for(dtypes), self.device_checks(),
                                      (HEADER_BYTES, self.arg_members),
                                      _source.kernel_block(threads), self.fusable(dtypes))

    @property
    def arg_members(self) -> tuple:
        """The C++ names of the argument words (`arg_fields`), in order: the same names."""
        return tuple(self.arg_fields)

    @property
    def outputs(self) -> tuple:
        """The arguments that are arrays the op writes into (`*_out` kernel arguments)."""
        return tuple(field for field in self.arg_fields if field.endswith("_out"))

    def field_of(self, name: str) -> str:
        """The kernel argument word of step argument `name` (a rule may rename it)."""
        return name

    def scheduled_word(self, name: str) -> str | None:
        """The argument word a new number for scheduled hyperparameter `name` (lr, step) goes
        to as given, where `arguments` checks it against `scalar_range(name)` alone and derives
        nothing else from it; None where a change of it needs `arguments` (the default)."""
        return None

    def output_numel(self, name: str, n_tensors: int) -> int:
        """Elements of the output array `name` (an `*_out` argument) for a list of n tensors."""
        raise NotImplementedError(f"{self.name} has no output {name}")

    def check_arguments(self, n_tensors: int, **hyper) -> None:
        """Checks hyperparameters as a step would, a per-tensor sequence value by value."""
        if rows_for(self, hyper, n_tensors, lambda name, value: value) is None:
            self.arguments(**hyper)

    def cpu_run(self, refs: dict, args: dict, grad_scale: float) -> bool:
        """The whole step on the CPU, for ops whose result spans tensors (a global norm);
        returns False to have the CPU backend call `cpu_update` tensor by tensor."""
        return False

    def cpu_tensors_apart(self) -> bool:
        """Whether `cpu_update` of several tensors may run at once (on threads): true of ops
        whose update of one tensor writes nothing another reads."""
        return False

    def cpu_batchable(self) -> bool:
        """Whether the CPU backend may step small tensors together, one `cpu_update` for the
        values of many tensors laid end to end: true of ops whose update is elementwise and
        takes the same arguments for every tensor (index aside)."""
        return False

    def cpu_in_place(self, args: dict, dtype):
        """For a `cpu_batchable` op, its update written straight into the tensors' memory: a
        function (arrays, dests, scratch) of one range of elements, with `n_buffers`, the
        number of scratch arrays it takes: arrays are read-only views of each list of `slots`,
        dests writable views of each written one, in that order, all in `dtype` (see
        mtapply._cpu `_run_in_place`); or None to have the CPU backend call `cpu_update`."""
        return None

    def cpu_eight_bit_in_place(self, args: dict, dtype):
        """For a `cpu_batchable` op with `eight_bit_slots`, its update of one range of whole
        blocks with those slots dequantized: a function (arrays, dests, scratch) as
        `cpu_in_place` has it, over the slots other than the scales, each 8-bit slot's values
        and dest one float array (then quantized again where the op writes it; see
        mtapply._cpu_eight_bit), with `n_buffers`; or None to have the CPU backend call
        `cpu_update`."""
        return None

    @property
    def key(self) -> tuple:
        return (self.name, self.flags)

    def call_key(self, n_tensors: int) -> tuple:
        """What tells two plans of this op over n tensors apart besides their tensors: the
        compile key and the per-tensor arrays (e.g. LARS's exclude flags)."""
        arrays = self.tensor_arrays(n_tensors)
        return (self.key, tuple((name, np.asarray(a).tobytes()) for name, a in arrays.items()))


def seed_words(seed) -> dict:
    """The 64-bit seed of stochastic rounding as the kernel arguments seed_lo and seed_hi."""
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    seed = int(seed)
    return {"seed_lo": float(seed & 0xFFFFFFFF), "seed_hi": float(seed >> 32)}


def check_number(name: str, value, *, low=None, high=None, high_open=False, low_open=False) -> float:
    """`value` as a float, or ValueError/TypeError naming `name` and the accepted range."""
    if type(value) is not float:  # the common case costs one type test: this runs every step
        value = _to_float(name, value)
    if (value != value or (low is not None and (value <= low if low_open else value < low))
            or (high is not None and (value >= high if high_open else value > high))):
        lo = "" if low is None else f"{'(' if low_open else '['}{low}, "
        hi = "" if high is None else f"{high}{')' if high_open else ']'}"
        rng = f"{lo}{hi}" if lo and hi else (f">{'' if low_open else '='} {low}" if lo else (
            f"<{'' if high_open else '='} {high}" if hi else "a number"))
        raise ValueError(f"{name} must be {rng}, got {value!r}")
    return value


def number_or_device_scalar(name: str, value, allowed: Range):
    """A DeviceScalar or a DLPack array (made a DeviceScalar by the plan) as is, checked by the
    kernel; else a number checked against `allowed`.

    NumPy scalars (np.float32, np.int64) become floats here, so they are range-checked too.
    """
    if isinstance(value, DeviceScalar) or hasattr(value, "__dlpack__"):
        return value
    return allowed.check(name, value)
