"""The op of a user-written rule (`mtapply.rule`): its kernel and CPU path generated from the
rule's checked program."""
from __future__ import annotations

import hashlib

from .. import _source
from ..rules import _cuda, _numpy
from ..rules._language import STEP, Program
from ._spec import DeviceScalar, OpSpec, check_number


class RuleSpec(OpSpec):
    """A rule as an op: slot k of the rule is the op's list `<name>s` (param -> params)."""

    flags = ()

    def __init__(self, name: str, program: Program, *, master_weights: bool = False):
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
        self.device_scalars = (*program.hyper, STEP)
        self._names = frozenset(self.device_scalars)
        # a rule that never reads the step does not need one
        self._defaults = (*program.hyper.items(), (STEP, None if program.uses_step else 1.0))
        # each value's accepted range: the declared one, and steps count from 1
        self._bounds = {**{name: accepted.bounds() for name, accepted in program.ranges.items()},
                        STEP: dict(low=1.0)}
        self._use_master_weights(master_weights)

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
            args[name] = self._checked(name, value)
        return args

    def _checked(self, name: str, value):
        """A device value as is (the kernel reads it); a number checked: finite, in range."""
        if isinstance(value, DeviceScalar) or hasattr(value, "__dlpack__"):
            return value
        value = check_number(name, value, **self._bounds[name])
        if value - value != 0.0:  # inf (NaN was refused above)
            raise ValueError(f"{name} must be a finite number, got {value!r}")
        return value

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        rule_arrays = {s.name: arrays[list_name(s.name)] for s in self.program.slots}
        scalars = {name: float(value) for name, value in args.items()}  # numbers on the CPU
        new = _numpy.evaluate(self.program, rule_arrays, scalars, dtype)
        return {list_name(name): values for name, values in new.items()}


def list_name(slot: str) -> str:
    """The op's list of a rule slot: param -> params, exp_avg -> exp_avgs."""
    return f"{slot}s"
