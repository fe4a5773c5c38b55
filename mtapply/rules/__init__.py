"""User-written optimizers: a rule of a few lines becomes a fused multi-tensor op.

    lion = mtapply.rule(
        "lion", slots="param:rw grad:r exp_avg:rw",
        hyper=dict(lr=(None, ">= 0"), beta1=(0.9, "[0, 1)"), beta2=(0.99, "[0, 1)"),
                   weight_decay=(0.0, ">= 0")),
        update='''
            c = beta1 * exp_avg + (1 - beta1) * grad
            param = param * (1 - lr * weight_decay) - lr * sign(c)
            exp_avg = beta2 * exp_avg + (1 - beta2) * grad
        ''')
    lion.step(params, grads, exp_avgs, lr=1e-4)        # one launch per dtype group, in place
    plan = lion.plan(params, grads, exp_avgs)          # bound once: plan.step(lr=1e-4)

Per-tensor reductions (`sums=`, as LARS and LAMB need) add a first pass; factored slots
(`NAME:rw@row`, `@col`, `@unfactored`, read with `row_mean` and `col_mean`: Adafactor's second
moment, see `_factored`) take row and column reductions before the update on a GPU; `library` holds the optimizers shipped as
rules (Lion, Adan, Adagrad, RMSprop, schedule-free AdamW, Adafactor).

The update is checked when the rule is made (`_language`), then generated twice from the same
checked program: a CUDA functor on mtapply's chunk walker (`_cuda`, compiled by NVRTC like the
built-in ops) and a NumPy path for the CPU (`_numpy`). Steps have the built-in ops' semantics:
checks before anything is written, AMP's grad_scale and found_inf, master weights for 16-bit
params, device scalars for any hyperparameter, the caller's stream, CUDA graphs.
"""
from __future__ import annotations

import textwrap

from .. import _calls
from ..plan import Plan
from ._factored import FULL, is_factored, slot_shape
from ._language import check_hyper, parse, parse_slots
from ._quantized import QuantizedRule
from ._spec import RuleSpec
from ._step_update import keep_source


class Rule:
    """A user-written optimizer: `step` and `plan` over lists in slot order."""

    def __init__(self, name: str, slots: str, hyper: dict, update: str, sums=None,
                 finish: str = "", scalars=None, totals=None):
        if not isinstance(name, str) or not name:
            raise TypeError("name must be a non-empty string")
        self.name = name
        self._source = (name, slots, dict(hyper), update,  # how pickle makes it again
                        dict(sums) if isinstance(sums, dict) else sums, finish,
                        dict(scalars) if isinstance(scalars, dict) else scalars,
                        dict(totals) if isinstance(totals, dict) else totals)
        parsed = parse_slots(slots)
        defaults, ranges = check_hyper(hyper, parsed)
        args = (parsed, defaults, textwrap.dedent(update), sums, textwrap.dedent(finish or ""),
                ranges, scalars, totals)
        self.program = parse(*args)
        keep_source(self.program, args)  # for its step variant (`_step_update`)
        self._specs: dict = {}

    @property
    def slots(self) -> tuple:
        """The rule's slot names, in the order `step` and `plan` take their lists."""
        return tuple(s.name for s in self.program.slots)

    @property
    def hyper(self) -> dict:
        """Hyperparameter name -> default (None: required at every step)."""
        return dict(self.program.hyper)

    @property
    def initial(self) -> dict:
        """State slot name -> its first value: a number, or "param" (a copy of the param), as
        declared in `slots` (0 where not). mtapply.torch and mtapply.optax make state so; the
        functional `step` and `plan` take the lists as given."""
        return {s.name: s.initial for s in self.program.slots[1:] if s.name != "grad"}

    @property
    def written_state(self) -> tuple:
        """The state slots the update writes (what `with_state_bits` may keep in 8 bits)."""
        return tuple(s.name for s in self.program.slots[1:] if s.written and s.name != "grad")

    @property
    def scalars(self) -> dict:
        """Scalar state name -> its value before the first step (see `initial_scalars`)."""
        return dict(self.program.scalars)

    def initial_scalars(self, dtype="float32"):
        """A rule with scalar state steps with `scalars_out=`: an array of three copies of its
        n scalars, in `scalars` order: float32, or float64 where every param is float64 (the
        plan's `sum_dtype`; its sums are then float64 too). A step reads the copy of the step
        before it (entries [(t - 1) % 2 * n:][:n] at step t) and writes the other one, so a
        step that is repeated or skipped reads what the step before it left; it writes the
        latest values into the last n entries too, where they stay put. This returns the
        array as it is before step 1 (NumPy, of `dtype`; copy it to the tensors' device)."""
        import numpy as np

        if np.dtype(dtype) not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64 (float64 for float64 params), "
                             f"got {dtype!r}")
        values = np.asarray(list(self.program.scalars.values()), dtype)
        return np.concatenate([values, values, values])

    @property
    def ranges(self) -> dict:
        """Hyperparameter name -> the range a step accepts, in words (">= 0.0 and finite"),
        "finite" where none was declared."""
        return {name: accepted.describe() for name, accepted in self.program.ranges.items()}

    def spec(self, master_weights: bool = False, stochastic_rounding: bool = False):
        """The rule's op (`mtapply.rules._spec.RuleSpec`), for the engine and the adapters."""
        key = (bool(master_weights), bool(stochastic_rounding))
        spec = self._specs.get(key)
        if spec is None:
            spec = self._specs[key] = RuleSpec(self.name, self.program,
                                               master_weights=master_weights,
                                               stochastic_rounding=stochastic_rounding)
        return spec

    @property
    def summed_first(self) -> tuple:
        """The state slots the update writes that cannot be kept in 8 bits because the rule's
        sums read them in a first pass and update its scalar state: a first pass over 8-bit
        slots stores nothing, and the update computes them again, which is the same
        computation only where no scalar state changes between the passes."""
        if not self.program.scalars:
            return ()
        return tuple(name for name in self.written_state if name in self.program.first_pass_slots)

    def with_state_bits(self, bits: int = 8, *, slots=None, unsigned=(),
                        threshold: int = 4096):
        """This rule with state slots kept in 8 bits (bitsandbytes' `optim_bits=8`): each of
        `slots` (default: every state slot the update writes) as uint8 codes of the blockwise
        dynamic format of `mtapply.quantization`, with one float32 scale per 256 elements; those
        in `unsigned` hold values >= 0 (second moments) on the finer unsigned map. Params of
        fewer than `threshold` elements keep float32 state. Returns a rule whose `step` and
        `plan` take the rule's lists then the scales of each 8-bit slot, and whose
        `state(params)` makes the state lists. `bits=32` returns this rule."""
        if bits == 32:
            return self
        if bits != 8:
            raise ValueError(f"bits must be 8 (or 32: float32 state), got {bits!r}")
        writable = self.written_state
        named = writable if slots is None else ((slots,) if isinstance(slots, str) else slots)
        for name in named:
            if name not in writable:
                raise ValueError(f"rule {self.name!r}: slots names {name!r}, but 8-bit state is "
                                 f"for the state slots the update writes ({', '.join(writable)})")
        # in slot order: the kernel finds each 8-bit slot's scales by its place among them
        chosen = tuple(name for name in writable if name in named)
        unsigned = (unsigned,) if isinstance(unsigned, str) else tuple(unsigned)
        for name in unsigned:
            if name not in chosen:
                raise ValueError(f"rule {self.name!r}: unsigned names {name!r}, which is not "
                                 f"among the 8-bit slots {chosen}")
        if not chosen:
            raise ValueError(f"rule {self.name!r} writes no state slot: nothing to keep in 8 bits")
        factored = [s.name for s in self.program.slots if s.name in chosen and s.form != FULL]
        if factored:
            raise ValueError(f"rule {self.name!r}: {factored[0]!r} is a factored slot, kept in "
                             f"float: name the other slots in slots=")
        summed = [name for name in chosen if name in self.summed_first]
        if summed:
            raise ValueError(f"rule {self.name!r} reads {summed[0]!r} in its sums, which update "
                             f"its scalar state before the update pass computes {summed[0]!r} "
                             f"again: keep it in float32, naming the other slots in slots=")
        return QuantizedRule(self, chosen, unsigned, int(threshold))

    def cuda_source(self) -> str:
        """The CUDA functor the rule generates (compiled after mtapply's chunk walker);
        NotImplementedError for a rule that runs on the CPU only (factored lines the GPU
        passes cannot run)."""
        self.spec().refuse_cuda()
        return self.spec().functor_text

    def state_shapes(self, shape, min_dim_size: int = 1) -> dict:
        """State slot name -> the shape of its tensor beside a param of `shape`: the param's,
        or for factored slots (see `mtapply.rules._factored`) a row or column vector where
        the param is factored (two or more dimensions, the last two each at least
        `min_dim_size`), and (0,) for a slot the param does not keep."""
        factored = is_factored(tuple(shape), min_dim_size)
        return {s.name: slot_shape(s.form, tuple(shape), factored)
                for s in self.program.slots[1:] if s.name != "grad"}

    def plan(self, *lists, master_params=None, stochastic_rounding=False, table_mode=None,
             stream=None):
        """Binds the lists (one per slot, in order) once; `plan.step(**hyper)` then steps them.
        `stochastic_rounding=True`: bfloat16 params are stored rounded stochastically, with
        random bits keyed by the step argument `seed`, the step and the param's place (the
        step then takes `step` whether or not the update reads it)."""

        spec = self.spec(master_params is not None, stochastic_rounding)
        return Plan(spec, self._tensors(spec, lists, master_params), table_mode=table_mode,
                    stream=stream)

    def step(self, *lists, master_params=None, stochastic_rounding=False, grad_scale=None,
             found_inf=None, stream=None, table_mode=None, **hyper) -> None:
        """One step over whole lists (one per slot, in order), in place (`stochastic_rounding`
        as in `plan`). A hyperparameter may be one value per tensor (a sequence), as a plan's."""

        spec = self.spec(master_params is not None, stochastic_rounding)
        spec.check_arguments(len(lists[0]) if lists else 0, **hyper)
        _calls.step(spec, self._tensors(spec, lists, master_params), table_mode=table_mode,
                    stream=stream, grad_scale=grad_scale, found_inf=found_inf, **hyper)

    def _tensors(self, spec, lists: tuple, master_params) -> dict:
        if len(lists) != len(self.program.slots):
            raise TypeError(f"rule {self.name!r} takes {len(self.program.slots)} lists "
                            f"({', '.join(self.slots)}), got {len(lists)}")
        tensors = dict(zip(spec.slots, lists))
        if master_params is not None:
            tensors["master_params"] = master_params
        return tensors

    def __repr__(self) -> str:
        """The rule's name, slots (with their access) and hyperparameters (with their defaults;
        None: required), and the names of its per-tensor sums, if any."""
        slots = " ".join(f"{s.name}:{'rw' if s.written else 'r'}"
                         + (f"@{s.form}" if s.form != FULL else "")
                         + (f"={s.initial:g}" if isinstance(s.initial, float) and s.initial
                            else f"={s.initial}" if isinstance(s.initial, str) else "")
                         for s in self.program.slots)
        per_tensor = [s.name for s in self.program.sums if not s.whole]
        named = f", sums={per_tensor!r}" if per_tensor else ""
        if self.program.totals:
            named += f", totals={[t.name for t in self.program.totals]!r}"
        if self.program.scalars:
            named += f", scalars={self.scalars!r}"
        return f"mtapply.rule({self.name!r}, slots={slots!r}, hyper={self.hyper!r}{named})"

    def __reduce__(self):  # its checked program refers to its own parse: made again from source
        return Rule, self._source

    def __deepcopy__(self, memo) -> Rule:
        return self  # a rule never changes once made


def rule(name: str, *, slots: str, hyper: dict, update: str, sums=None, finish: str = "",
         scalars=None, totals=None) -> Rule:
    """A fused multi-tensor optimizer from a few lines (see the module docstring).

    Args:
        name: the rule's name, for messages.
        slots: the per-param tensors as "NAME:r" or "NAME:rw", in the order `step` takes their
            lists: "param:rw" first, and "grad:r" among them. A state slot may declare its
            first value, "NAME:rw=1e-6" or "NAME:rw=param" (a copy of the param), which
            mtapply.torch and mtapply.optax give new state (0 where none is declared), and
            its form, "NAME:rw@row", "@col" or "@unfactored": factored state, one value per
            row or column of a param's last two dimensions (`state_shapes`; the update
            reads row_mean(x) and col_mean(x) and chooses with `A if factored else B`).
            On a GPU their means are reductions run before the update
            (`_factored_passes` says which lines that takes).
        hyper: name -> default of each scalar hyperparameter (None: required), or name ->
            (default, range), the range a step accepts: ">= 0", "> 0", "<= 1", "< 1", or an
            interval "[0, 1)" (any brackets). Each may be a number (finite, in its range, or
            a ValueError before anything is written) or a one-element float32 device array at
            step time; `step` (the 1-based step count) is always available too.
        update: one assignment per line (see `mtapply.rules._language`).
        sums: name -> expression of per-tensor sums (e.g. {"p2": "param * param"}), computed
            by a first pass over the values the update's lines leave before the first line
            that reads a sum; each is then a per-tensor number in the update (this is how LARS
            and LAMB trust ratios are written). Deterministic: fixed summation order.
        finish: lines of per-tensor values computed from the sums (no slots), run before the
            update's first line that reads a sum or a finish value.
        totals: name -> expression of sums over every element of the whole list (a global
            gradient norm: {"g2": "grad * grad"}), computed in the first pass as `sums` are and
            added up over the tensors in a fixed order (deterministic, no host
            synchronisation); each is then one number for every tensor. Over tensors on
            several GPUs, every device adds all devices' totals in one order.
        scalars: name -> initial value of numbers kept between steps for the whole list (NAdam's
            running product of momentum factors): in the update a name reads the value the
            previous step left, and a line assigning it (from numbers, hyperparameters, step
            and scalars) sets the next step's. Each step then takes `scalars_out=`, a float32
            array (float64 where every param is float64, as the sums then are) on the first
            tensor's device made from `initial_scalars(dtype)`, which it updates, with one
            value per hyperparameter.
            `mtapply.torch.optimizer` keeps the array per param group; `mtapply.optax` keeps
            the scalars as fields of its state (on the CPU, or through the host callback).

    Raises:
        ValueError, TypeError: at once, naming the line, for unknown names, a write to a
        read-only slot, an rw slot never written, a comparison used as a number, a call
        outside the rule functions, division by a literal 0.
    """
    return Rule(name, slots, hyper, update, sums, finish, scalars, totals)


__all__ = ["Rule", "rule"]
