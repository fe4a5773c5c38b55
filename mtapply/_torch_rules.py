"""`mtapply.torch` optimizers run by a rule (`mtapply.rule`): the built-in ones of the rule
library (Lion, Adan, AdEMAMix, ScheduleFreeAdamW, Adamax, Adadelta, NAdam, RAdam, Adagrad,
RMSprop; those that estimate their step size are in `_torch_adaptive.py`) and any user-written
rule."""
from __future__ import annotations

import numbers

import torch

from ._ranges import LR, Range
from ._torch_checks import check_adam_args, check_one_element, check_options
from . import quantization
from ._dtensor import is_dtensor, local_tensor, sharded_like, sharded_scales
from ._torch_layouts import as_real
from ._torch_optimizer import BETA_NAMES, FusedOptimizer, laid_out_as
from ._torch_state import (MASTER, check_eight_bit_slots, check_state_bits, own_options,
                           refuse_other_state_bits)
from .ops._spec import check_number, seed_words
from .rules import library
from .rules._factored import COL, FULL, ROW, UNFACTORED, is_factored, slot_shape
from .rules._spec import sum_dtype_of


class RuleBased(FusedOptimizer):
    """Optimizers run by a rule (`mtapply.rule`): each group's rule and hyperparameters, state
    tensors named after the rule's slots beside the device step counter `step`.

    A rule's scalar state (NAdam's `mu_product`) is one array (`Rule.initial_scalars`) per
    group's params of one device and step count (one plan), which the step's launches update;
    each of their states holds a zero-dimensional view of its latest values under the
    scalar's name (shared, as the step counter is), saved as torch.optim saves them."""

    _merges_groups = True
    _UNSIGNED_STATE: tuple = ()  # state slots that hold values >= 0 (finer 8-bit codes)
    # a rule with factored slots keeps them for params of two or more dimensions whose last
    # two are each at least this size (torch.optim.Adafactor: every such param)
    _min_dim_size_to_factor = 1

    def __init__(self, params, defaults, flat_grads=False, state_bits=32, min_8bit_size=4096,
                 stochastic_rounding=False, seed=0, master_weights=False):
        check_state_bits(state_bits, min_8bit_size)
        self.state_bits, self.min_8bit_size = state_bits, min_8bit_size
        self._eight_bit_rules: dict = {}
        seed_words(seed)  # (checked now; a group option, as Adam's)
        defaults = dict(defaults, **own_options(stochastic_rounding=bool(stochastic_rounding),
                                                seed=seed))
        super().__init__(params, defaults, flat_grads, master_weights)
        for group in self.param_groups:  # a rule that cannot keep 8-bit state refuses now
            self._stepping_rule(group)
            if self.master_weights:  # (a rule that does not write its param takes no masters)
                self._rule(group).spec(master_weights=True)

    def __getstate__(self):  # a copy keeps its state's storage
        return dict(super().__getstate__(), state_bits=self.state_bits,
                    min_8bit_size=self.min_8bit_size)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)  # (load_state_dict's state lacks them: they stay)
        self.__dict__.setdefault("state_bits", 32)
        self.__dict__.setdefault("min_8bit_size", 4096)
        self._eight_bit_rules = {}

    def _stepping_rule(self, group):
        """The group's rule as it steps: with state_bits=8, its written state slots in 8 bits
        (`Rule.with_state_bits`) but those its whole-list sums read first (`summed_first`:
        float32), params under min_8bit_size keeping float32 state."""
        rule = self._rule(group)
        if self.state_bits != 8:  # (16: the rule's kernels take bfloat16 state as it is)
            return rule
        made = self._eight_bit_rules.get(rule)
        if made is None:
            slots = [s for s in rule.written_state if s not in rule.summed_first]
            if not slots:
                raise ValueError(
                    f"{type(self).__name__}(state_bits=8): its sums over the whole list read "
                    f"{', '.join(rule.summed_first)} before the step updates "
                    f"{', '.join(rule.scalars)}, so its state cannot be kept in 8 bits; use "
                    f"state_bits=16 (bfloat16 state) or 32")
            unsigned = [s for s in self._UNSIGNED_STATE if s in slots]
            made = self._eight_bit_rules[rule] = rule.with_state_bits(
                8, slots=slots, unsigned=unsigned, threshold=self.min_8bit_size)
        return made

    def _tensor_options(self, group) -> bool:
        return any(isinstance(v, torch.Tensor) for v in self._rule_hyper(group).values())

    def _rule(self, group):
        raise NotImplementedError

    def _rule_hyper(self, group) -> dict:
        """The rule's hyperparameters from a group's options (the same names by default)."""
        return {name: group[name] for name in self._rule(group).hyper}

    def _initial(self, group, p, name: str):
        """A new state tensor of slot `name`: its declared first value (see `mtapply.rule`)."""
        value = self._rule(group).initial.get(name, 0.0)
        if value == "param":
            return p.detach().clone(memory_format=torch.preserve_format)
        if p.is_complex():  # stepped as its real view: both parts start at the value
            value = complex(value, value)
        return torch.full_like(p, value, memory_format=torch.preserve_format)

    def _compile_options(self, group) -> tuple:
        return (self._stepping_rule(group), self._stochastic(group))

    @staticmethod
    def _stochastic(group) -> bool:
        """Whether the group's bfloat16 params are rounded stochastically (random bits keyed
        by its `seed`, the step and the param's place), as Adam's option."""
        return bool(group.get("stochastic_rounding", False))

    def _spans_devices(self, group) -> bool:
        return bool(self._stepping_rule(group).program.totals)

    def _counts_per_group(self, group) -> bool:
        # a rule with whole-list sums steps its params as one list, with one step count (as
        # prodigyopt's and dadaptation's group count k), and one scalar state
        return bool(self._stepping_rule(group).program.totals)

    def _check_prepared(self, prepared: list, scaled: bool) -> None:
        """A rule with whole-list sums (a global norm, Prodigy's d) sums over one plan: its
        params must step together, in one plan (torch.optim's counterparts sum over every param
        of the step), which may span GPUs; FSDP2 shards' sums are all-reduced between the
        passes."""
        summed = [(group, bound) for _, group, bound, _ in prepared
                  if bound is not None and self._stepping_rule(group).program.totals]
        for group, bound in summed:
            if any(part.plan is not None and part.plan.spans_devices for part in bound.parts):
                self._check_across_devices(group, scaled)
        parts = [part for _, bound in summed for part in bound.parts]
        if len(parts) > 1:
            name = self._stepping_rule(summed[0][0]).name
            raise ValueError(
                f"{type(self).__name__} ({name}) sums over all its params at each step, which "
                f"here would step as {len(parts)} separate lists: params on the CPU and a GPU, "
                f"16-bit params beside others under master_weights=True, param groups that "
                f"cannot step together (a tensor lr, other compile-time options), or groups at "
                f"different step counts (one added later). Keep the params on one device and "
                f"give the groups number lrs")

    def _check_across_devices(self, group, scaled: bool) -> None:
        """Over params on several GPUs every device reads the step's values as numbers: no
        GradScaler scale or inf flag, no tensor hyperparameter."""
        name = f"{type(self).__name__} ({self._stepping_rule(group).name}) over params on several GPUs"
        if scaled:
            raise ValueError(f"{name} takes no GradScaler (its scale and inf flag are tensors "
                             f"on one GPU): unscale and check the grads yourself, or keep the "
                             f"params on one GPU")
        tensors = [key for each in group.get("groups", [group]) for key, value in each.items()
                   if key != "params" and any(isinstance(v, torch.Tensor) for v in (
                       value if isinstance(value, (tuple, list)) else (value,)))]
        if tensors:
            raise ValueError(f"{name} takes its hyperparameters as numbers, but {tensors[0]} is "
                             f"a tensor: give it as a float")

    def _factored_shapes(self, group, p) -> dict:
        """The shapes of the factored slots that `p` keeps (see `mtapply.rules._factored`):
        @row and @col where it is factored, @unfactored where not; empty for a rule without
        factored slots."""
        program = self._rule(group).program
        if not program.factored:
            return {}
        factored = is_factored(tuple(p.shape), self._min_dim_size_to_factor)
        kept = {ROW: factored, COL: factored, UNFACTORED: not factored}
        return {s.name: slot_shape(s.form, tuple(p.shape), factored)
                for s in program.slots if s.form != FULL and kept[s.form]}

    def _state_names(self, group, p) -> tuple:
        """The state slots a param keeps (a factored rule's, by the param's shape)."""
        program, kept = self._rule(group).program, self._factored_shapes(group, p)
        absent = {s.name for s in program.slots if s.form != FULL and s.name not in kept}
        return tuple(name for name in self._stepping_rule(group).slots[1:]
                     if name != "grad" and name not in absent)

    def _init_state(self, group, p, state) -> None:
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        rule = self._stepping_rule(group)
        missing = [name for name in self._state_names(group, p) if name not in state]
        source = state.get(MASTER, p)  # a state that starts at the param: at its fp32 master
        shapes = self._factored_shapes(group, p)
        for name in missing:
            if name in shapes:  # a row or column vector, or a full @unfactored slot
                state[name] = torch.full(shapes[name], float(rule.initial[name]),
                                         dtype=self._state_dtype(group, name, p),
                                         device=p.device)
            elif self.state_bits == 8 and name in rule.eight_bit:
                state[name], state[f"{name}_absmax"] = self._eight_bit_state(
                    rule, name, p, self._initial(group, p, name))
            elif not name.endswith("_absmax"):  # (made with its slot)
                first = self._initial(group, source, name)
                dtype = self._state_dtype(group, name, p)
                state[name] = first if first.dtype == dtype else first.to(dtype)

    @staticmethod
    def _eight_bit_state(rule, name: str, p, first) -> tuple:
        """(codes, scales) of an 8-bit slot starting at `first` (its declared first value), in
        the param's dense layout (the blocks follow memory order); float32 values and no scales
        for a param under min_8bit_size elements. A DTensor param's are its shard's, as
        DTensors (see mtapply._dtensor), in 8 bits as the whole param is."""
        eight_bit = as_real(p.detach()).numel() >= rule.threshold
        if is_dtensor(p):
            values, scales = RuleBased._slot_state(rule, name, local_tensor(p), local_tensor(first),
                                                  eight_bit)
            return sharded_like(p, values), sharded_scales(p, scales, eight_bit)
        return RuleBased._slot_state(rule, name, p, first, eight_bit)

    @staticmethod
    def _slot_state(rule, name: str, p, first, eight_bit: bool) -> tuple:
        form = as_real(p.detach())  # as the plan steps it: complex as real
        values = as_real(first.detach())
        if not eight_bit:
            return values.float(), torch.zeros(0, dtype=torch.float32, device=p.device)
        codes = laid_out_as(torch.zeros(form.shape, dtype=torch.uint8, device=p.device), form)
        if not values.any():  # zeros: any codes, at a scale of 0
            return codes, torch.zeros(quantization.n_blocks(form.numel()), dtype=torch.float32,
                                      device=p.device)
        dense = laid_out_as(torch.zeros(form.shape, device=p.device), form).copy_(values)
        flat = dense.as_strided((dense.numel(),), (1,))  # memory order
        made, scales = quantization.quantize_blockwise(flat.cpu().numpy(),
                                                       signed=name not in rule.unsigned)
        codes.as_strided((codes.numel(),), (1,)).copy_(torch.from_numpy(made))
        return codes, torch.from_numpy(scales).to(p.device)

    def _keeps_dtype(self, key, value) -> bool:
        return self.state_bits == 8  # uint8 codes, float32 scales and float32 small state

    def _state_dtype(self, group, name: str, param):
        """With state_bits=16 the state slots the update writes are bfloat16 (those of real
        floating params); else the param's dtype (see StateKeeping)."""
        if (self.state_bits == 16 and param.is_floating_point()
                and name in self._rule(group).written_state):
            return torch.bfloat16
        return super()._state_dtype(group, name, param)

    def _check_entry(self, group, param, entry, where) -> None:
        eight_bit = getattr(self._stepping_rule(group), "eight_bit", ())
        refuse_other_state_bits(type(self).__name__, eight_bit, entry, where)
        super()._check_entry(group, param, entry, where)
        check_eight_bit_slots(param, eight_bit, entry, where)

    def _required_state(self, group, param) -> tuple:
        rule = self._stepping_rule(group)  # `step` where the update reads it
        return ((("step",) if rule.program.uses_step else ()) + self._state_names(group, param)
                + tuple(rule.scalars))

    def _bind(self, key, options, group, params, grads):
        bound = super()._bind(key, options, group, params, grads)
        if self._rule(group).scalars:
            taken: set = set()  # parts that a step count split apart keep arrays of their own
            for part in bound.parts:
                part.scalars = self._scalar_array(group, part.params, taken)
                taken.add(id(part.scalars))
        return bound

    def _scalar_array(self, group, params, taken: set):
        """The scalar state array of params that share a step count (a part), from their
        state entries: the views of an array they share still (and no other part took),
        else the values they hold (loaded, or set); each entry then becomes a view of the
        new array's latest values."""
        rule, state = self._rule(group), self.state
        names, n = tuple(rule.scalars), len(rule.scalars)
        entries = [[state[p].get(name) for name in names] for p in params]
        first = entries[0]
        dtype = _scalar_dtype(params)
        if all(isinstance(v, torch.Tensor) and v._base is not None for v in first) and all(
                all(v is w for v, w in zip(entry, first)) for entry in entries):
            array = first[0]._base  # the part's own array, as the last bind left it
            if (array.numel() == 3 * n and array.device == params[0].device
                    and array.dtype == dtype and id(array) not in taken
                    and (self._counts_per_group(group)
                         or not self._held_elsewhere(array, group, params, names[0]))):
                return array
        values = []
        for k, name in enumerate(names):
            given = {float(entry[k]) for entry in entries if entry[k] is not None}
            if len(given) > 1:
                raise ValueError(f"{type(self).__name__} keeps one {name!r} for params of one "
                                 f"group and step count, but they hold {sorted(given)}: give "
                                 f"the params of each {name!r} a param group of their own")
            values.append(given.pop() if given else float(rule.initial_scalars()[k]))
        array = torch.tensor(values * 3, dtype=dtype, device=params[0].device)
        views = [array[2 * n + k] for k in range(n)]
        for p in params:
            for name, view in zip(names, views):
                state[p][name] = view
        return array

    def _held_elsewhere(self, array, group, params, name: str) -> bool:
        """Whether a param of the group outside `params` (one that missed this step) holds
        views of `array`: it keeps its values, so the stepping params take a new array."""
        stepping = set(map(id, params))
        for p in group["params"]:
            view = self.state.get(p, {}).get(name) if id(p) not in stepping else None
            if isinstance(view, torch.Tensor) and view._base is array:
                return True
        return False

    def _part_hyper(self, part, group) -> dict:
        hyper = super()._part_hyper(part, group)
        if part.scalars is not None:  # bound by `_bind` for a rule with scalar state
            hyper["scalars_out"] = part.scalars
        return hyper

    def _checked_values(self, group) -> dict:
        values = super()._checked_values(group)
        if self._rule(group).scalars:  # the group's own array, made by the step
            values["scalars_out"] = self._rule(group).initial_scalars()
        return values

    def _saved_entry(self, entry, param, group, reads: dict) -> dict:
        saved = super()._saved_entry(entry, param, group, reads)
        if param is not None and group is not None:
            on_device = group.get("fused") or group.get("capturable")
            for name in self._rule(group).scalars:  # torch.optim's layout: a CPU scalar
                if isinstance(saved.get(name), torch.Tensor):
                    saved[name] = saved[name].to(device=param.device if on_device else "cpu",
                                                 copy=True)
        return saved

    def _make_plan(self, group, lists):
        given, rule = {"param": lists.bound, "grad": lists.grads}, self._stepping_rule(group)
        masters = {} if lists.masters is None else {"master_params": lists.masters}  # (not 8-bit)
        factored = tuple(s.name for s in rule.program.slots if s.form != FULL)
        return rule.plan(*(given[name] if name in given else
                           self._factored_state(lists, name, factored) if name in factored else
                           lists.state(name) for name in rule.slots),
                         stochastic_rounding=self._stochastic(group), **masters)

    def _factored_state(self, lists, name: str, factored: tuple) -> list:
        """Each param's tensor of factored slot `name` as kept (vectors, made contiguous), or
        an empty one where the param keeps none, of the dtype of the param's other factored
        slots: factored and unfactored params of one dtype then share a launch (bfloat16
        params' empty slots in float32 split them in two)."""
        tensors = []
        for p in lists.params:
            state = self.state[p]
            kept = state.get(name)
            if kept is None:
                like = next((state[n] for n in factored if n in state), None)
                kept = torch.empty(0, device=p.device,
                                   dtype=torch.float32 if like is None else like.dtype)
            tensors.append(kept)
        return tensors

    def _values(self, group) -> dict:
        hyper = self._rule_hyper(group)
        if self._stochastic(group):
            hyper["seed"] = group.get("seed", 0)
        return hyper

    def _checking_spec(self, group):
        return self._rule(group).spec(stochastic_rounding=self._stochastic(group))

    def _range(self, group, name: str) -> Range:
        return self._rule(group).program.ranges[name]


class RuleOptimizer(RuleBased):
    """A user-written rule (`mtapply.rule`) as a `torch.optim.Optimizer`, made by `optimizer`.

    Each hyperparameter of the rule is a param group option (its default from the rule; a rule
    default of None is required, as torch's `lr` is); any may be a float or a one-element
    float32 tensor on the params' device. Each slot other than param and grad is a per-param
    state tensor of that name, zero at first, beside the device step counter `step`.
    """

    def __init__(self, rule, params, *, flat_grads=False, state_bits=32, min_8bit_size=4096,
                 stochastic_rounding=False, seed=0, master_weights=False, **hyper):
        from torch.optim.optimizer import required

        if "lr" not in rule.hyper:
            raise TypeError(f"rule {rule.name!r} has no lr: a torch optimizer's param groups "
                            f"(and LR schedulers) drive the rule's lr hyperparameter; declare one")
        masks = getattr(rule, "masks", None)
        if masks:  # optax's masks are pytrees of the params: torch has param groups instead
            name = sorted(masks)[0]
            raise ValueError(f"rule {rule.name!r} masks {name!r} with an optax mask, which a torch "
                             f"optimizer cannot apply: make the link without mask= and give "
                             f"{name} per param group (e.g. {name}=0.0 in a group of biases)")
        unknown = sorted(set(hyper) - set(rule.hyper))
        if unknown:
            raise TypeError(f"rule {rule.name!r} has no hyperparameter {unknown[0]!r} (it takes "
                            f"{', '.join(rule.hyper)})")
        for name, value in hyper.items():
            check_one_element(value, name)
        self.rule = rule
        if rule.scalars:
            self._merges_groups = False  # a scalar state per group (per step count)
        defaults = {name: hyper.get(name, required if default is None else default)
                    for name, default in rule.hyper.items()}
        super().__init__(params, defaults, flat_grads, state_bits, min_8bit_size,
                         stochastic_rounding, seed, master_weights)

    def __getstate__(self):
        return dict(super().__getstate__(), rule=self.rule)  # a copy steps by the same rule

    def _rule(self, group):
        return self.rule


class Lion(RuleBased):
    """Lion (lion-pytorch's arguments and state: `exp_avg`), from `mtapply.rules.library.lion`:
    p = p * (1 - lr * wd) - lr * sign(beta1 * m + (1 - beta1) * g); m = beta2 * m + (1 - beta2) * g.
    """

    _OPTION_NAMES = BETA_NAMES

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *,
                 flat_grads=False, state_bits=32, min_8bit_size=4096,
                 stochastic_rounding=False, seed=0, master_weights=False):
        check_adam_args(lr, betas, 0.0, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), flat_grads,
                         state_bits, min_8bit_size, stochastic_rounding, seed, master_weights)

    def _rule(self, group):
        return library.lion()

    def _rule_hyper(self, group) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])


class Adan(RuleBased):
    """Adan (`mtapply.rules.library.adan`, optax.adan's update) with the arguments of the
    authors' PyTorch implementation: betas=(beta1, beta2, beta3), eps, weight_decay (decoupled:
    p -= lr * (update + weight_decay * p)). State: `m`, `v`, `n`, `prev_grad`, `step`."""

    _UNSIGNED_STATE = ("n",)

    _OPTION_NAMES = BETA_NAMES

    def __init__(self, params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0,
                 *, flat_grads=False, state_bits=32, min_8bit_size=4096,
                 stochastic_rounding=False, seed=0, master_weights=False):
        check_options(lr=lr, eps=eps, weight_decay=weight_decay)
        for k, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {k}: {beta}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay), flat_grads, state_bits,
                         min_8bit_size, stochastic_rounding, seed, master_weights)

    def _rule(self, group):
        return library.adan()

    def _rule_hyper(self, group) -> dict:
        beta1, beta2, beta3 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, beta3=beta3, eps=group["eps"],
                    eps_root=0.0, weight_decay=group["weight_decay"])


class AdEMAMix(RuleBased):
    """AdEMAMix (`mtapply.rules.library.ademamix`) with bitsandbytes' arguments and defaults:
    betas=(beta1, beta2, beta3), alpha, t_alpha and t_beta3 (warm-up lengths in steps of alpha
    and beta3; None: none), eps, weight_decay (decoupled: p (1 - lr wd)). State: `exp_avg` (the
    fast moment, bitsandbytes' m1), `exp_avg_slow` (m2), `exp_avg_sq` (nu) and `step`;
    bitsandbytes stacks m1 and m2 in one `state1` tensor, so checkpoints do not move between
    them. With state_bits=8 all three moments are 8-bit, `exp_avg_sq` on the unsigned map."""

    _UNSIGNED_STATE = ("exp_avg_sq",)

    _OPTION_NAMES = BETA_NAMES

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None,
                 t_beta3=None, eps=1e-8, weight_decay=1e-2, *, flat_grads=False, state_bits=32,
                 min_8bit_size=4096, stochastic_rounding=False, seed=0, master_weights=False):
        check_options(lr=lr, eps=eps, weight_decay=weight_decay, alpha=alpha)
        if isinstance(betas, torch.Tensor) or len(betas) != 3:
            raise ValueError(f"Invalid betas: {betas!r} (three: beta1, beta2, beta3)")
        for k, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {k}: {beta}")
        for name, value in (("t_alpha", t_alpha), ("t_beta3", t_beta3)):
            self._check_period(name, value)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), alpha=alpha, t_alpha=t_alpha,
                                      t_beta3=t_beta3, eps=eps, weight_decay=weight_decay),
                         flat_grads, state_bits, min_8bit_size, stochastic_rounding, seed,
                         master_weights)

    @staticmethod
    def _check_period(name: str, value, where: str = "") -> None:
        """A warm-up length: None (none) or a finite number of steps above 0."""
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
                0.0 < value < float("inf")):
            raise ValueError(f"{where}Invalid {name} value: {value!r} (a number of steps > 0, "
                             f"or None for no warm-up)")

    def _check_group(self, index: int, group) -> None:
        for name in ("t_alpha", "t_beta3"):
            self._check_period(name, group[name], f"param group {index}: ")
        super()._check_group(index, group)

    def _rule(self, group):
        return library.ademamix()

    def _rule_hyper(self, group) -> dict:
        beta1, beta2, beta3 = group["betas"]
        t_alpha, t_beta3 = group["t_alpha"], group["t_beta3"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, beta3=beta3, alpha=group["alpha"],
                    t_alpha=0.0 if t_alpha is None else t_alpha,
                    t_beta3=0.0 if t_beta3 is None else t_beta3, eps=group["eps"],
                    weight_decay=group["weight_decay"])


class ScheduleFreeAdamW(RuleBased):
    """Schedule-free AdamW (`mtapply.rules.library.schedule_free_adamw`) with the update of
    optax.contrib.schedule_free_adamw and the arguments and train()/eval() of the authors'
    AdamWScheduleFree: the params hold y while training; `eval()` puts the average x in them
    and `train()` puts y back. Per group, the running max lr, the sum of the averaging weights
    and the steps taken are host numbers in the group (saved with state_dict); each param's
    state holds `z` (a copy of the param at first), `nu` and `step`. lr is a number (the weights
    are computed on the host: a tensor lr is read there at each step, which costs a CUDA one a
    synchronisation); a step skipped by GradScaler still advances them.

    `state_bits=8` keeps `nu` in 8 bits (unsigned codes beside `nu_absmax`; float32 for params
    under `min_8bit_size` elements), `state_bits=16` in bfloat16. `z` stays in the params'
    dtype whatever state_bits says: it is the base sequence the params are interpolated from
    at every step and by train()/eval(), so its codes' error would move the params themselves
    (a checkpoint that holds an 8-bit z is refused, naming it)."""

    _merges_groups = False  # its per-group running values live in each group
    _UNSIGNED_STATE = ("nu",)
    _FLOAT_STATE = ("z",)  # kept as the params are (see the class docstring)

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 warmup_steps=0, weight_lr_power=2.0, *, flat_grads=False, state_bits=32,
                 min_8bit_size=4096, master_weights=False):
        check_options(lr=lr, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps)
        if not 0.0 < betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas} (beta1 in (0, 1), beta2 in [0, 1))")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        warmup_steps=warmup_steps, weight_lr_power=weight_lr_power,
                        lr_max=0.0, weight_sum=0.0, k=0, train_mode=True)
        super().__init__(params, defaults, flat_grads, state_bits, min_8bit_size,
                         master_weights=master_weights)

    def _rule(self, group):
        return library.schedule_free_adamw()

    def _stepping_rule(self, group):
        """With state_bits=8, the rule with `nu` in 8 bits and `z` as it is."""
        rule = self._rule(group)
        if self.state_bits != 8:
            return rule
        made = self._eight_bit_rules.get(rule)
        if made is None:
            eight_bit = tuple(s for s in rule.written_state if s not in self._FLOAT_STATE)
            made = self._eight_bit_rules[rule] = rule.with_state_bits(
                8, slots=eight_bit, unsigned=self._UNSIGNED_STATE, threshold=self.min_8bit_size)
        return made

    def _state_dtype(self, group, name: str, param):
        if name in self._FLOAT_STATE:  # not bfloat16 with state_bits=16 either
            return FusedOptimizer._state_dtype(self, group, name, param)
        return super()._state_dtype(group, name, param)

    def _check_entry(self, group, param, entry, where) -> None:
        for name in self._FLOAT_STATE:
            if f"{name}_absmax" in entry:
                raise ValueError(f"{where()} holds {name!r} in 8 bits ({name + '_absmax'!r}); "
                                 f"{type(self).__name__} keeps {name!r}, the base sequence the "
                                 f"params are interpolated from, in the params' dtype with any "
                                 f"state_bits: load a state saved by {type(self).__name__}")
        super()._check_entry(group, param, entry, where)

    def _before_groups(self, grad_scale, found_inf, flat_buffers) -> None:
        for index, group in enumerate(self.param_groups):  # a tensor lr, filled in place
            if isinstance(group["lr"], torch.Tensor):
                LR.check(f"param group {index}: lr", float(group["lr"]))

    def _prepare_group(self, index, group):
        if not group["train_mode"]:
            raise RuntimeError("ScheduleFreeAdamW.step() in eval mode: call optimizer.train() "
                               "first (eval() put the averaged params in place)")
        return super()._prepare_group(index, group)

    def _launch_group(self, index, group, bound, grad_scale, found_inf) -> None:
        """Advances the group's running values (every step the group takes, whichever way it
        was prepared: with flat_grads too), then steps it. They are the optimizer's own
        values, not options: set without noting a change of the group."""
        if bound is None or not bound.parts:
            return  # no step for this group: its averaging weights stay as they are
        k = group["k"]
        lr_max = max(group["lr_max"], self._scheduled(group, k + 1))
        weight = lr_max ** group["weight_lr_power"]
        weight_sum = group["weight_sum"] + weight
        for key, value in (("_lr", self._scheduled(group, k)),  # the base step's, as optax's
                           ("lr_max", lr_max), ("weight_sum", weight_sum),
                           ("_ck", weight / weight_sum if weight_sum > 0 else 0.0),
                           ("k", k + 1)):
            dict.__setitem__(group, key, value)
        super()._launch_group(index, group, bound, grad_scale, found_inf)

    _OPTION_NAMES = {"b1": "betas[0]", "b2": "betas[1]"}

    def _checked_values(self, group) -> dict:
        # the step's lr is at most the group's; the averaging weight ck is in [0, 1]
        return dict(self._rule_hyper(dict(group, _lr=group["lr"], _ck=0.0)), step=1.0)

    def _check_group(self, index: int, group) -> None:
        super()._check_group(index, group)
        check_number(f"param group {index}: warmup_steps", group["warmup_steps"], low=0.0)
        check_number(f"param group {index}: weight_lr_power", group["weight_lr_power"])

    @staticmethod
    def _scheduled(group, step: int) -> float:
        """optax.warmup_constant_schedule(0, lr, warmup_steps) at `step`."""
        warmup = group["warmup_steps"]
        return float(group["lr"]) * (min(step, warmup) / warmup if warmup > 0 else 1.0)

    def _rule_hyper(self, group) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["_lr"], b1=beta1, b2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], ck=group["_ck"])

    @torch.no_grad()
    def eval(self) -> None:
        """Puts x, the average to evaluate, in the params."""
        self._swap(to_train=False)

    @torch.no_grad()
    def train(self) -> None:
        """Puts y, the point the gradients are taken at, back in the params."""
        self._swap(to_train=True)

    def _swap(self, to_train: bool) -> None:
        for group in self.param_groups:
            if group["train_mode"] == to_train:
                continue
            beta1 = group["betas"][0]
            for p in group["params"]:
                entry = self.state.get(p, {})
                z = entry.get("z")
                if z is None:
                    continue
                # y = b1 x + (1 - b1) z, both ways as a lerp towards z (of the fp32 master, then
                # rounded into the param, where the param steps through one)
                weight = 1 - beta1 if to_train else 1 - 1 / beta1
                master = entry.get(MASTER) if self._takes_master(p) else None
                if master is not None:
                    p.copy_(master.lerp_(z, weight))
                else:
                    p.lerp_(z, weight)
            group["train_mode"] = to_train


class AdamFamily(RuleBased):
    """Rule-run optimizers of torch.optim's Adam family: `betas` as the rule's beta1 and
    beta2, each other hyperparameter the group option of its name."""

    _UNSIGNED_STATE = ("exp_avg_sq", "exp_inf")

    _OPTION_NAMES = BETA_NAMES

    def _start(self, params, flat_grads, storage: tuple, lr, betas, eps, weight_decay,
               **options) -> None:
        """The optimizer, its defaults the family's shared arguments and `options` (the class's
        own and torch.optim's flags), after the class checked them as torch.optim does;
        `storage`: state_bits, min_8bit_size, stochastic_rounding, seed and master_weights."""
        RuleBased.__init__(self, params, dict(lr=lr, betas=betas, eps=eps,
                                              weight_decay=weight_decay, **options), flat_grads,
                           *storage)

    def _rule_hyper(self, group) -> dict:
        betas = dict(zip(("beta1", "beta2"), group["betas"]))
        return {name: betas[name] if name in betas else group[name]
                for name in self._rule(group).hyper}


class Adamax(AdamFamily):
    """`torch.optim.Adamax` (same arguments and state: `exp_avg`, `exp_inf`, `step`) from
    `mtapply.rules.library.adamax`; `foreach`, `capturable` and `differentiable=False` are
    accepted for compatibility."""

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 foreach=None, *, maximize=False, differentiable=False, capturable=False,
                 flat_grads=False, state_bits=32, min_8bit_size=4096,
                 stochastic_rounding=False, seed=0, master_weights=False):
        check_adam_args(lr, betas, eps, weight_decay)
        self._start(params, flat_grads, (state_bits, min_8bit_size, stochastic_rounding, seed,
                                       master_weights),
                    lr, betas, eps, weight_decay, foreach=foreach, maximize=maximize,
                    differentiable=differentiable, capturable=capturable)

    def _rule(self, group):
        return library.adamax(bool(group["maximize"]))


class NAdam(AdamFamily):
    """`torch.optim.NAdam` (same arguments and state: `exp_avg`, `exp_avg_sq`, `mu_product`,
    `step`) from `mtapply.rules.library.nadam`, whose `mu_product` is scalar state, kept on
    the device for the params of a group that share a step count (see RuleBased), as their
    per-param values are equal in torch.optim. `foreach`, `capturable` and
    `differentiable=False` are accepted for compatibility."""

    _merges_groups = False  # a mu_product per group (per step count)

    def __init__(self, params, lr=2e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 momentum_decay=4e-3, decoupled_weight_decay=False, *, foreach=None,
                 maximize=False, capturable=False, differentiable=False, flat_grads=False,
                 state_bits=32, min_8bit_size=4096, stochastic_rounding=False, seed=0,
                 master_weights=False):
        check_adam_args(lr, betas, eps, weight_decay)
        if not 0.0 <= momentum_decay:
            raise ValueError(f"Invalid momentum_decay value: {momentum_decay}")
        self._start(params, flat_grads, (state_bits, min_8bit_size, stochastic_rounding, seed,
                                       master_weights),
                    lr, betas, eps, weight_decay,
                    momentum_decay=momentum_decay, decoupled_weight_decay=decoupled_weight_decay,
                    foreach=foreach, maximize=maximize, capturable=capturable,
                    differentiable=differentiable)

    def _rule(self, group):
        return library.nadam(bool(group["decoupled_weight_decay"]), bool(group["maximize"]))


class RAdam(AdamFamily):
    """`torch.optim.RAdam` (same arguments and state: `exp_avg`, `exp_avg_sq`, `step`) from
    `mtapply.rules.library.radam`; `foreach`, `capturable` and `differentiable=False` are
    accepted for compatibility."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 decoupled_weight_decay=False, *, foreach=None, maximize=False,
                 capturable=False, differentiable=False, flat_grads=False,
                 state_bits=32, min_8bit_size=4096, stochastic_rounding=False, seed=0,
                 master_weights=False):
        check_adam_args(lr, betas, eps, weight_decay)
        self._start(params, flat_grads, (state_bits, min_8bit_size, stochastic_rounding, seed,
                                       master_weights),
                    lr, betas, eps, weight_decay,
                    decoupled_weight_decay=decoupled_weight_decay, foreach=foreach,
                    maximize=maximize, capturable=capturable, differentiable=differentiable)

    def _rule(self, group):
        return library.radam(bool(group["decoupled_weight_decay"]), bool(group["maximize"]))


class Adadelta(RuleBased):
    """`torch.optim.Adadelta` (same arguments and state: `square_avg`, `acc_delta`, `step`) from
    `mtapply.rules.library.adadelta`; `foreach`, `capturable` and `differentiable=False` are
    accepted for compatibility."""

    _UNSIGNED_STATE = ("square_avg", "acc_delta")

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, foreach=None, *,
                 capturable=False, maximize=False, differentiable=False, flat_grads=False,
                 state_bits=32, min_8bit_size=4096, stochastic_rounding=False, seed=0,
                 master_weights=False):
        check_options(lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= float(rho) <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, foreach=foreach,
                        capturable=capturable, maximize=maximize, differentiable=differentiable)
        super().__init__(params, defaults, flat_grads, state_bits, min_8bit_size,
                         stochastic_rounding, seed, master_weights)

    def _rule(self, group):
        return library.adadelta(bool(group["maximize"]))


class Adagrad(RuleBased):
    """`torch.optim.Adagrad` (same arguments and state: `sum`, `step`) from
    `mtapply.rules.library.adagrad`; `foreach`, `fused` and `differentiable=False` are accepted
    for compatibility. Params with sparse grads take torch.optim's own per-tensor update, as
    SGD's do."""

    _UNSIGNED_STATE = ("sum",)

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, flat_grads=False,
                 state_bits=32, min_8bit_size=4096, stochastic_rounding=False, seed=0,
                 master_weights=False):
        check_options(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                       initial_accumulator_value=initial_accumulator_value, eps=eps)
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                        maximize=maximize, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, flat_grads, state_bits, min_8bit_size,
                         stochastic_rounding, seed, master_weights)

    _sparse_grads = True

    def _rule(self, group):
        return library.adagrad(bool(group["maximize"]))

    def _split_sparse(self, index, group, grad_scale, found_inf) -> tuple:
        dense, sparse = super()._split_sparse(index, group, grad_scale, found_inf)
        if sparse and self.state_bits == 8:  # before any group steps
            raise ValueError("Adagrad with state_bits=8 steps dense grads only (sparse grads "
                             "update the state row by row in float): use state_bits=32")
        return dense, sparse

    def _sparse_step(self, group, params) -> None:
        from torch.optim.adagrad import adagrad

        for p in params:  # its own step count, on the CPU as torch.optim keeps it
            self._init_param_state(group, p)
            self.state[p]["step"] = torch.tensor(float(self.state[p]["step"]),
                                                 dtype=torch.float32)
        adagrad(params, [p.grad for p in params], [self.state[p]["sum"] for p in params],
                [self.state[p]["step"] for p in params], has_sparse_grad=True, foreach=False,
                lr=group["lr"], weight_decay=group["weight_decay"], lr_decay=group["lr_decay"],
                eps=group["eps"], maximize=bool(group["maximize"]))

    def _initial(self, group, p, name: str):
        value = float(group["initial_accumulator_value"])
        if p.is_complex():  # as torch: both parts of the real view start at the value
            value = complex(value, value)
        return torch.full_like(p, value, memory_format=torch.preserve_format)


class RMSprop(RuleBased):
    """`torch.optim.RMSprop` (same arguments and state: `square_avg`, `grad_avg`,
    `momentum_buffer`, `step`) from `mtapply.rules.library.rmsprop`; `foreach`, `capturable`
    and `differentiable=False` are accepted for compatibility. Turning `centered` or momentum
    on starts `grad_avg` or `momentum_buffer` at zero where torch.optim raises KeyError."""

    _UNSIGNED_STATE = ("square_avg",)

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                 centered=False, capturable=False, foreach=None, maximize=False,
                 differentiable=False, *, flat_grads=False, state_bits=32, min_8bit_size=4096,
                 stochastic_rounding=False, seed=0, master_weights=False):
        check_options(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                       momentum=momentum)
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, centered=centered, capturable=capturable,
                        foreach=foreach, maximize=maximize, differentiable=differentiable)
        super().__init__(params, defaults, flat_grads, state_bits, min_8bit_size,
                         stochastic_rounding, seed, master_weights)

    def _rule(self, group):
        return library.rmsprop(bool(group["centered"]), group["momentum"] > 0,
                               bool(group["maximize"]))

    def _check_group(self, index: int, group) -> None:
        super()._check_group(index, group)  # momentum too, where it is above 0
        check_number(f"param group {index}: momentum", group["momentum"], low=0.0)

    def _required_state(self, group, param) -> tuple:
        return ("step", "square_avg")  # grad_avg, momentum_buffer start when their options do


def optimizer(rule, params, *, flat_grads=False, state_bits=32, min_8bit_size=4096,
              stochastic_rounding=False, seed=0, master_weights=False, **hyper) -> RuleOptimizer:
    """`rule` (from `mtapply.rule`) as a torch.optim.Optimizer over `params` (params or param
    groups), with the rule's hyperparameters as options: param groups, state_dict, LR
    schedulers, GradScaler and `flat_grads` as the built-in optimizers have them.
    `state_bits=8` keeps the state slots the rule writes in 8 bits (`Rule.with_state_bits`;
    signed codes: a rule with a slot of values >= 0 may pass `rule.with_state_bits(...)` itself
    for finer ones), params under `min_8bit_size` elements in float32. `master_weights=True`
    steps float16 and bfloat16 params through fp32 masters (see `mtapply.torch`).

    Example:
        >>> opt = mtapply.torch.optimizer(lion, model.parameters(), lr=1e-4, weight_decay=0.1)
    """
    return RuleOptimizer(rule, params, flat_grads=flat_grads, state_bits=state_bits,
                         min_8bit_size=min_8bit_size, stochastic_rounding=stochastic_rounding,
                         seed=seed, master_weights=master_weights, **hyper)


def _scalar_dtype(params):
    """A rule's scalar state dtype over these params (`rules._spec.sum_dtype_of`)."""
    # (a complex param steps as its real view: complex128 as float64)
    return getattr(torch, sum_dtype_of(str(p.dtype.to_real()).removeprefix("torch.")
                                       for p in params))
