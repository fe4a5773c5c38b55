"""The op of a user-written rule (`mtapply.rule`): its kernel and CPU path generated from the
rule's checked program."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from .. import _cpu, _source
from .._ranges import ANY
from .._validate import SUPPORTED_DTYPES
from ..ops._spec import OpSpec, number_or_device_scalar, seed_words
from . import _cuda, _factored, _factored_cuda, _factored_passes, _numpy
from ._factored import FULL
from ._language import STEP, Program
from ._step_update import step_program

SUMMING_CHUNK = 8192  # elements per CUDA block for a rule with sums (see `chunk_for`)
SUMMING_CHUNK_16BIT = 65536  # the same where every slot is 16-bit


def sum_dtype_of(param_dtypes) -> str:
    """The dtype of a rule's sums and scalar state over params of these dtypes (names, as
    "float64"): float64 where every param is float64, so that they keep the params' precision
    (D-Adaptation's d from float64 sums); float32 else (mixed lists too)."""
    return "float64" if set(param_dtypes) == {"float64"} else "float32"

class RuleSpec(OpSpec):
    """A rule as an op: slot k of the rule is the op's list `<name>s` (param -> params)."""

    flags = ()

    def __init__(self, name: str, program: Program, *, master_weights: bool = False,
                 stochastic_rounding: bool = False, tensor_values: dict | None = None,
                 store_first: bool = True):
        if (master_weights or stochastic_rounding) and not program.slots[0].written:
            raise ValueError(f"rule {name!r} keeps state only (param:r): master_params and "
                             f"stochastic_rounding are for rules that update the params")
        self.program = program
        self.rule_name = name
        self.store_first = store_first
        if program.factored:  # shaped by the engine's checks here, not by ingestion
            names = [list_name(s.name) for s in program.slots if s.form != FULL]
            self.slot_formats = {n: (SUPPORTED_DTYPES, False) for n in names}
            self.cpu_shaped = True
        # hyperparameters fixed with the plan, one value per tensor (kernel arrays)
        self.tensor_values = _tensor_values(name, program, tensor_values or {})
        stochastic = bool(stochastic_rounding)
        # (store_first: the first pass of a rule with sums stores what the update then reads)
        made = _made(program, stochastic, tuple(self.tensor_values), store_first)
        self.digest = made.digest
        self.name = f"rule:{name}:{made.digest}"
        self.kernel_file, self.functor_text = made.kernel_file, made.text
        _source.register_generated(self.kernel_file, made.includes + self.functor_text)
        self.functor, self._functors, self._stored_functors = (made.functor, made.functors,
                                                               made.stored_functors)
        self.n_sums = len(program.sums)
        self.n_totals = len(program.totals)
        self.slots, self.written = made.slots, made.written
        self.arg_fields, self._members = made.arg_fields, made.members
        self.device_scalars = made.device_scalars
        self._names = frozenset(self.device_scalars) | frozenset(self.outputs)
        # one array of scalar state, or whole-list sums: shared by the devices of a plan; scalar
        # state also takes one value per hyperparameter (its lines read them once for the list)
        self.shared = bool(program.scalars or program.totals)
        self.uniform_hyper = bool(program.scalars)
        self._fields = made.fields
        # a rule that never reads the step does not need one
        hyper = tuple((h, v) for h, v in program.hyper.items() if h not in self.tensor_values)
        self._defaults = (*hyper, (STEP, None if program.uses_step else 1.0))
        self.ranges = dict(program.ranges)  # as declared (steps count from 1, as every op's)
        self._use_master_weights(master_weights)
        self._use_stochastic_rounding(stochastic)  # (adds _cuda.STOCHASTIC_WORDS to arg_fields)
        if stochastic:  # the random bits differ from step to step: the step is always given
            self._members += _cuda.STOCHASTIC_WORDS
            self._defaults = (*hyper, (STEP, None))
            self._names = self._names | {"seed"}

    def with_param_mode(self, mode: str):
        """As OpSpec's; "delta" writes the step itself as the update where the rule's param
        line is `param - x` or `param + x` (`_step_update`), not new - old."""
        stepped = step_program(self.program) if mode == "delta" and type(self) is RuleSpec else None
        if stepped is None:
            return super().with_param_mode(mode)
        spec = self.__dict__.get("_delta_step")
        if spec is None:
            spec = OpSpec.with_param_mode(RuleSpec(self.rule_name, stepped,
                                                   tensor_values=self.tensor_values,
                                                   store_first=self.store_first), mode)
            spec.delta_is_step = True
            spec.flags = tuple(spec.flags) + (("DELTA_STEP", True),)
            self.__dict__["_delta_step"] = spec
        return spec

    @property
    def key(self) -> tuple:
        """The functors' digest tells the variants of a rule apart, whatever name a subclass
        shows (SGD with and without Nesterov share the name `sgd`)."""
        return (self.name, self.digest, self.flags)

    @property
    def arg_members(self) -> tuple:
        return self._members  # prefixed C++ names (rules._cuda.c_fields)

    def field_of(self, name: str) -> str:
        return self._fields.get(name, name)

    @property
    def functors(self) -> tuple:
        """With sums, the summing pass, then the update."""
        return self._functors

    def functors_for(self, dtypes: tuple) -> tuple:
        """Where the first pass can store the slots the update would compute again, and those
        slots are kept in the math type (rounding them to a narrower storage would change the
        update), the pair whose first pass stores them."""
        if self._stored_functors:
            math = "float64" if dtypes[0] == "float64" else "float32"
            if all(dtypes[self.slots.index(list_name(name))] == math
                   for name in self.program.stored_first):
                return self._stored_functors
        return self._functors

    def scheduled_word(self, name: str) -> str | None:
        if name in self.scheduled and any(name == known for known, _ in self._defaults):
            return self._fields[name]  # `arguments` packs it as given
        return None

    def arguments(self, **hyper) -> dict:
        """Each hyperparameter (its default where it has one) and the step, checked."""
        if not hyper.keys() <= self._names:
            unknown = sorted(set(hyper) - self._names)
            raise TypeError(f"rule {self.rule_name!r} has no hyperparameter {unknown[0]!r} "
                            f"(it takes {', '.join(self.device_scalars)})")
        args = {}
        for name, default in self._defaults:
            value = hyper.get(name, default)
            if value is None:
                why = (" (stochastic_rounding draws other bits at each step)"
                       if name == STEP and self.stochastic_rounding else "")
                raise TypeError(f"rule {self.rule_name!r} needs {name}=...: a number or a "
                                f"one-element float32 device array{why}")
            args[self._fields[name]] = number_or_device_scalar(name, value,
                                                               self.scalar_range(name))
        if self.stochastic_rounding:
            args.update(seed_words(hyper.get("seed", 0)))
        if self.outputs:
            state = hyper.get(_cuda.SCALARS)
            if state is None:
                raise TypeError(f"rule {self.rule_name!r} keeps scalar state "
                                f"({', '.join(self.program.scalars)}): pass {_cuda.SCALARS}=, a "
                                f"float32 (float64 for float64 params) array on the tensors' "
                                f"device made from the rule's initial_scalars(dtype), the same "
                                f"one every step")
            args[_cuda.SCALARS] = state
        return args

    def output_numel(self, name: str, n_tensors: int) -> int:
        """Three copies of the scalar state (see `Rule.initial_scalars`)."""
        return 3 * len(self.program.scalars)

    def tensor_arrays(self, n_tensors: int) -> dict:
        arrays = super().tensor_arrays(n_tensors)
        for name, values in self.tensor_values.items():
            if len(values) != n_tensors:
                raise ValueError(f"{name} has {len(values)} values but the lists have {n_tensors} "
                                 f"tensors: give one value per tensor")
            arrays[_cuda.array_field(name)] = values
        return arrays

    def refuse_cuda(self) -> None:
        """NotImplementedError for a rule that has no CUDA functor (`cuda_refusal`)."""
        why = cuda_refusal(self.program)
        if why:
            raise NotImplementedError(
                f"rule {self.rule_name!r} runs on the CPU only: {why}; step these tensors on "
                f"the CPU")

    def sum_dtype(self, param_dtypes) -> str:
        return sum_dtype_of(param_dtypes)

    def fusable(self, dtypes: tuple) -> bool:
        """Per-tensor sums only (no whole-list sums, scalar state or factored slots), taken by
        a first pass that stores nothing (not the pair of `functors_for` whose first pass
        stores) and an update walked by the chunk walker (not 8-bit state's own walk)."""
        program = self.program
        return (bool(program.sums) and not (program.totals or program.scalars or program.factored)
                and self.functors_for(dtypes) == self._functors and len(self._functors) == 2
                and not self.walks_itself(dtypes))

    def chunk_for(self, dtypes: tuple) -> int:
        """A factored rule's blocks take longer chunks: each makes its op (hyperparameters and
        shape) once for 32,768 elements rather than 4,096 (Adafactor's gpt2-124M step 2.24 ->
        1.61 ms on an H200). A rule with sums takes 8,192: half the partial sums to write and
        add up, half the ops made in each pass (LARS's resnet50 step 0.1813 -> 0.1794 ms; 16,384
        gave 0.1864). Where every slot is 16-bit a rule with sums takes 65,536: its chunks of
        8,192 held too few bytes for their blocks' cost (all-bfloat16 LAMB on gpt2-124M 1.388 ->
        1.001 ms, LARS 0.516 -> 0.430, on an H200; float32's stay best at 8,192)."""
        if self.program.factored:
            return _factored_cuda.CHUNK
        if not self.program.sums:
            return super().chunk_for(dtypes)
        narrow = all(_source.ITEMSIZES.get(dtype) == 2 for dtype in dtypes)
        return SUMMING_CHUNK_16BIT if narrow else SUMMING_CHUNK

    def threads_for(self, dtypes: tuple, numels, sms: int = 0) -> int:
        """Whole blocks for a factored rule: its reductions share rows among warps."""
        if self.program.factored:
            return _source.BLOCK_THREADS
        return super().threads_for(dtypes, numels, sms)

    def shape_words(self, refs: dict):
        """For a factored rule, (its `shape_array` words for these tensors, the doubles of its
        `means_array`), see `_factored_cuda`; None for other rules."""
        if not self.program.factored:
            return None
        params = refs[self.slots[0]]
        for i, param in enumerate(params):  # (the XLA route comes here without check_tensors)
            self._check_factored(refs, i, param)
        factored = [self._mode(refs, i, p) for i, p in enumerate(params)]
        return _factored_cuda.shape_words(
            [p.shape if mode else (p.numel,) for p, mode in zip(params, factored)],
            *_factored_cuda.counts(self.program),
            n_products=len(_factored_cuda.product_sums(self.program)))

    def vector_passes(self) -> tuple:
        """The indices of a factored rule's combine and matrix passes, which launch over the
        blocks that `vector_blocks` gives work only (kernels/factored.cuh, MatrixBlock)."""
        if not self.program.factored:
            return ()
        names = _factored_cuda.reduction_names(self.program)  # (none without a CUDA kernel)
        return tuple(k for k, name in enumerate(names)
                     if name in (_factored_cuda.COMBINE, _factored_cuda.MATRIX))

    def vector_blocks(self, words: np.ndarray, chunk: int, threads: int) -> np.ndarray:
        """Per tensor of these `shape_array` words, its first blocks (of `chunk` elements and
        `threads` threads) that the vector passes give work (`_factored_cuda.vector_blocks`)."""
        n_matrix, n_row, n_col = _factored_cuda.counts(self.program)
        return _factored_cuda.vector_blocks(words, n_row, n_col, n_matrix, chunk, threads,
                                            len(_factored_cuda.product_sums(self.program)))

    def _mode(self, refs: dict, i: int, param) -> bool:
        sizes: dict = {}
        for s in self.program.slots:
            if s.form != FULL:
                sizes.setdefault(s.form, []).append(refs[list_name(s.name)][i].numel)
        return bool(_factored.mode_of(param.shape, sizes))

    def check_tensors(self, refs: dict) -> None:
        super().check_tensors(refs)
        params = refs[self.slots[0]]
        if any(ref.device[0] == "cuda" for ref in params):
            self.refuse_cuda()
        if self.program.factored:
            for i, param in enumerate(params):
                self._check_factored(refs, i, param)

    def _check_factored(self, refs: dict, i: int, param) -> None:
        """A param's factored slots hold the vectors of a factored param, or are empty beside
        full @unfactored slots (`mtapply.rules._factored`)."""
        forms = [s for s in self.program.slots if s.form != FULL]
        sizes: dict = {}
        for s in forms:
            sizes.setdefault(s.form, []).append(refs[list_name(s.name)][i].numel)
        if _factored.mode_of(param.shape, sizes) is not None:
            return
        shapes = {mode: {s.name: _factored.slot_shape(s.form, param.shape, mode) for s in forms}
                  for mode in ((True, False) if len(param.shape) >= 2 else (False,))}
        given = ", ".join(f"{list_name(s.name)}[{i}] {refs[list_name(s.name)][i].shape}"
                          for s in forms)
        expected = " or ".join(", ".join(f"{n} {shape}" for n, shape in each.items())
                               for each in shapes.values())
        raise ValueError(f"rule {self.rule_name!r}: params[{i}] has shape {param.shape} but "
                         f"{given}: its factored slots are {expected} (shape (0,): none; see "
                         f"Rule.state_shapes)")

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        rule_arrays, factored, shapes = self._rule_arrays(arrays)
        state = _cpu.view(args[_cuda.SCALARS].ref) if self.outputs else None
        new = _numpy.evaluate(self.program, rule_arrays, self._scalars(args, index), dtype, state,
                              args.get(_cuda.TOTALS), factored,
                              args.get(_cpu.SUM_DTYPE, "float32"), args.get(_cpu.GIVEN_SUMS))
        return {list_name(name): values.reshape(shapes[name]) if shapes else values
                for name, values in new.items()}

    def _rule_arrays(self, arrays: dict) -> tuple:
        """(slot name -> values, whether the param steps factored, slot name -> the shape its
        results are given back in (None: as they come)). A factored rule's arrays come in
        their tensors' shapes (`cpu_shaped`) and go to the program as
        `_factored.canonical_shape`s (all flat for an unfactored param)."""
        rule_arrays = {s.name: arrays[list_name(s.name)] for s in self.program.slots}
        if not self.program.factored:
            return rule_arrays, None, None
        shape = rule_arrays["param"].shape
        forms = {s.name: s.form for s in self.program.slots}
        sizes: dict = {}
        for name, form in forms.items():
            if form != FULL:
                sizes.setdefault(form, []).append(rule_arrays[name].size)
        factored = bool(_factored.mode_of(shape, sizes))
        shapes = {name: values.shape for name, values in rule_arrays.items()}
        for name, values in rule_arrays.items():
            if factored and forms[name] != _factored.UNFACTORED:  # (those stay empty)
                rule_arrays[name] = values.reshape(_factored.canonical_shape(forms[name], shape))
            else:
                rule_arrays[name] = values.reshape(-1)
        return rule_arrays, factored, shapes

    def cpu_tensors_apart(self) -> bool:
        """Tensor by tensor a rule writes only its own slots, but for its scalar state."""
        return not self.outputs

    def cpu_batchable(self) -> bool:
        """Elementwise where the program takes no sums and no value per tensor."""
        return not self.program.sums and not self.tensor_values and not self.program.factored

    def cpu_in_place(self, args: dict, dtype):
        """The update of `cpu_update` written into the tensors' memory (`_numpy.in_place`,
        its slots in the order of `slots`), or None (a rule with sums or scalar state, or one
        `cpu_batchable` refuses)."""
        if not self.cpu_batchable():
            return None
        update = _numpy.in_place(self.program, self._scalars(args, 0), dtype)
        if update is not None:
            update.n_buffers = _numpy.compiled(self.program).n_buffers
        return update

    def cpu_sums(self, index: int, arrays: dict, args: dict, dtype) -> list:
        """Tensor `index`'s sums (`program.sums` order), as its first pass takes them."""
        rule_arrays, factored, _ = self._rule_arrays(arrays)
        return _numpy.tensor_sums(self.program, rule_arrays, self._scalars(args, index), dtype,
                                  _cpu.view(args[_cuda.SCALARS].ref) if self.outputs else None,
                                  factored, args.get(_cpu.SUM_DTYPE, "float32"))

    def cpu_whole_sums(self, per_tensor: list, sum_dtype: str):
        """The whole-list sums from each tensor's `cpu_sums`."""
        return _numpy.whole_sums(self.program, per_tensor, sum_dtype)

    def _scalars(self, args: dict, index: int) -> dict:
        """Each hyperparameter's (and the step's) value for tensor `index`."""
        scalars = {name: float(args[field]) for name, field in self._fields.items()}
        scalars.update((name, float(values[index])) for name, values in self.tensor_values.items())
        return scalars


_STRUCT = "MTA_RULE_STRUCT"  # the functors' name in the text a digest is taken of


@dataclass(frozen=True)
class _Made:
    """What a spec takes from its program and options: its functors' C++ and names, its lists
    and its argument words."""

    digest: str
    text: str
    kernel_file: str
    functor: str
    functors: tuple
    stored_functors: tuple
    slots: tuple
    written: frozenset
    arg_fields: tuple
    members: tuple
    device_scalars: tuple
    fields: dict
    includes: str  # the headers the functors' text follows


def _made(program: Program, stochastic: bool, arrays: tuple, store_first: bool) -> _Made:
    """Made once per program and options and kept with the program: specs are made at every
    one-call step (and by the adapters' checks)."""
    made = program.__dict__.setdefault("_specs", {})
    key = (stochastic, arrays, store_first)
    if key not in made:
        why = cuda_refusal(program)
        text = (_cuda.functor_source(program, _STRUCT, stochastic, arrays, store_first)
                if not why else _cpu_only_text(program, why))
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        struct = f"Rule_{digest}"
        scalars = (*(h for h in program.hyper if h not in arrays), STEP)
        made[key] = _Made(
            digest, text.replace(_STRUCT, struct), f"rule_{digest}.cuh", f"mta::{struct}",
            _cuda.functor_names(program, struct),
            _cuda.stored_functor_names(program, struct) if store_first else (),
            tuple(list_name(s.name) for s in program.slots),
            frozenset(list_name(s.name) for s in program.slots if s.written),
            _cuda.arg_fields(program, arrays), _cuda.arg_members(program, arrays), scalars,
            {name: _cuda.field_name(name) for name in scalars},
            '#include "walker.cuh"\n' + ('#include "factored.cuh"\n' if program.factored else ""))
    return made[key]


def cuda_refusal(program: Program) -> str:
    """Why a rule has no CUDA kernel ("" where it has one): a factored rule whose lines the
    GPU passes cannot run (`_factored_passes`); another rule that reads means or numel."""
    if program.factored:
        return _factored_passes.refusal(program)
    return program.cpu_only


def _cpu_only_text(program: Program, why: str) -> str:
    """What stands for the functors of a rule that has none (`cuda_refusal`): its lines, so
    that its digest tells it apart."""
    lines = [f"// {s.name}:{'rw' if s.written else 'r'}@{s.form}" for s in program.slots]
    lines += [f"// {line.text}" for line in program.lines]
    lines += [f"// sum {s.name} = {s.text}" for s in program.sums]
    return "\n".join(["// runs on the CPU only: " + why, *lines]) + "\n"


def _tensor_values(rule: str, program: Program, given: dict) -> dict:
    """name -> float32 array of one value per tensor, each checked against the range the rule
    declares for hyperparameter `name`."""
    values = {}
    for name, column in given.items():
        if name not in program.hyper:
            raise ValueError(f"rule {rule!r} has no hyperparameter {name!r} to give per tensor "
                             f"(it takes {', '.join(program.hyper)})")
        column = np.asarray(column, dtype=np.float64).reshape(-1)
        for i, value in enumerate(column):
            program.ranges.get(name, ANY).check(f"{name}[{i}]", float(value))
        values[name] = column.astype(np.float32)
    return values


def list_name(slot: str) -> str:
    """The op's list of a rule slot: param -> params, exp_avg -> exp_avgs."""
    return f"{slot}s"
