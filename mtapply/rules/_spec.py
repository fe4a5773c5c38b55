"""The op of a user-written rule (`mtapply.rule`): its kernel and CPU path generated from the
rule's checked program."""
from __future__ import annotations

import hashlib

from .. import _cpu, _source
from ..ops._spec import OpSpec, number_or_device_scalar
from . import _cuda, _numpy
from ._language import STEP, Program


class RuleSpec(OpSpec):
    """A rule as an op: slot k of the rule is the op's list `<name>s` (param -> params)."""

    flags = ()

    def __init__(self, name: str, program: Program, *, master_weights: bool = False):
        if master_weights and not program.slots[0].written:
            raise ValueError(f"rule {name!r} keeps state only (param:r): master_params are "
                             f"for rules that update the params")
        self.program = program
        self.rule_name = name
        digest = hashlib.sha256(_cuda.functor_source(program, "Rule").encode()).hexdigest()[:16]
        struct = f"Rule_{digest}"
        self.name = f"rule:{name}:{digest}"
        self.kernel_file = f"rule_{digest}.cuh"
        self.functor_text = _cuda.functor_source(program, struct)
        _source.register_generated(self.kernel_file,
                                   '#include "walker.cuh"\n' + self.functor_text)
        self.functor = f"mta::{struct}"
        self._functors = _cuda.functor_names(program, struct)
        self.n_sums = len(program.sums)
        self.slots = tuple(list_name(s.name) for s in program.slots)
        self.written = frozenset(list_name(s.name) for s in program.slots if s.written)
        self.arg_fields = _cuda.arg_fields(program)
        self._members = _cuda.arg_members(program)
        self.device_scalars = (*program.hyper, STEP)
        self._names = frozenset(self.device_scalars) | frozenset(self.outputs)
        # one array of scalar state for the whole list: one device, one value per hyperparameter
        self.single_device = bool(program.scalars)
        self._fields = {name: _cuda.field_name(name) for name in self.device_scalars}
        # a rule that never reads the step does not need one
        self._defaults = (*program.hyper.items(), (STEP, None if program.uses_step else 1.0))
        self.ranges = dict(program.ranges)  # as declared (steps count from 1, as every op's)
        self._use_master_weights(master_weights)

    @property
    def arg_members(self) -> tuple:
        return self._members  # prefixed C++ names (rules._cuda.c_fields)

    def field_of(self, name: str) -> str:
        return self._fields.get(name, name)

    @property
    def functors(self) -> tuple:
        """With sums, the summing pass, then the update."""
        return self._functors

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
                raise TypeError(f"rule {self.rule_name!r} needs {name}=...: a number or a "
                                f"one-element float32 device array")
            args[self._fields[name]] = number_or_device_scalar(name, value,
                                                               self.scalar_range(name))
        if self.outputs:
            state = hyper.get(_cuda.SCALARS)
            if state is None:
                raise TypeError(f"rule {self.rule_name!r} keeps scalar state "
                                f"({', '.join(self.program.scalars)}): pass {_cuda.SCALARS}=, a "
                                f"float32 array on the tensors' device made from the rule's "
                                f"initial_scalars(), the same one every step")
            args[_cuda.SCALARS] = state
        return args

    def output_numel(self, name: str, n_tensors: int) -> int:
        """Three copies of the scalar state (see `Rule.initial_scalars`)."""
        return 3 * len(self.program.scalars)

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        rule_arrays = {s.name: arrays[list_name(s.name)] for s in self.program.slots}
        scalars = {name: float(args[field]) for name, field in self._fields.items()}
        state = _cpu.view(args[_cuda.SCALARS].ref) if self.outputs else None
        new = _numpy.evaluate(self.program, rule_arrays, scalars, dtype, state)
        return {list_name(name): values for name, values in new.items()}


def list_name(slot: str) -> str:
    """The op's list of a rule slot: param -> params, exp_avg -> exp_avgs."""
    return f"{slot}s"
