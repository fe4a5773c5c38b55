"""`mtapply.torch` optimizers run by a rule (`mtapply.rule`): the built-in ones of the rule
library (Lion, Adan, ScheduleFreeAdamW, Adamax, Adadelta, NAdam, RAdam, Adagrad, RMSprop) and any
user-written rule."""
from __future__ import annotations


import torch

from ._ranges import LR, Range
from ._torch_checks import check_adam_args, check_one_element, check_options
from ._torch_optimizer import BETA_NAMES, FusedOptimizer
from .ops._spec import check_number
from .rules import library


class RuleBased(FusedOptimizer):
    """Optimizers run by a rule (`mtapply.rule`): each group's rule and hyperparameters, state
    tensors named after the rule's slots beside the device step counter `step`.

    A rule's scalar state (NAdam's `mu_product`) is one array (`Rule.initial_scalars`) per
    group's params of one device and step count (one plan), which the step's launches update;
    each of their states holds a zero-dimensional view of its latest values under the
    scalar's name (shared, as the step counter is), saved as torch.optim saves them."""

    _merges_groups = True

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
        return (self._rule(group),)

    def _init_state(self, group, p, state) -> None:
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for name in self._rule(group).slots[1:]:
            if name != "grad" and name not in state:
                state[name] = self._initial(group, p, name)

    def _required_state(self, group, param) -> tuple:
        rule = self._rule(group)  # `step` where the update reads it
        return (("step",) if rule.program.uses_step else ()) + tuple(
            name for name in rule.slots[1:] if name != "grad") + tuple(rule.scalars)

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
        if all(isinstance(v, torch.Tensor) and v._base is not None for v in first) and all(
                all(v is w for v, w in zip(entry, first)) for entry in entries):
            array = first[0]._base  # the part's own array, as the last bind left it
            if (array.numel() == 3 * n and array.device == params[0].device
                    and id(array) not in taken):
                return array
        values = []
        for k, name in enumerate(names):
            given = {float(entry[k]) for entry in entries if entry[k] is not None}
            if len(given) > 1:
                raise ValueError(f"{type(self).__name__} keeps one {name!r} for params of one "
                                 f"group and step count, but they hold {sorted(given)}: give "
                                 f"the params of each {name!r} a param group of their own")
            values.append(given.pop() if given else float(rule.initial_scalars()[k]))
        array = torch.tensor(values * 3, dtype=torch.float32, device=params[0].device)
        views = [array[2 * n + k] for k in range(n)]
        for p in params:
            for name, view in zip(names, views):
                state[p][name] = view
        return array

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
        given, rule = {"param": lists.bound, "grad": lists.grads}, self._rule(group)
        return rule.plan(*(given[name] if name in given else lists.state(name)
                           for name in rule.slots))

    def _values(self, group) -> dict:
        return self._rule_hyper(group)

    def _checking_spec(self, group):
        return self._rule(group).spec()

    def _range(self, group, name: str) -> Range:
        return self._rule(group).program.ranges[name]


class RuleOptimizer(RuleBased):
    """A user-written rule (`mtapply.rule`) as a `torch.optim.Optimizer`, made by `optimizer`.

    Each hyperparameter of the rule is a param group option (its default from the rule; a rule
    default of None is required, as torch's `lr` is); any may be a float or a one-element
    float32 tensor on the params' device. Each slot other than param and grad is a per-param
    state tensor of that name, zero at first, beside the device step counter `step`.
    """

    def __init__(self, rule, params, *, flat_grads=False, **hyper):
        from torch.optim.optimizer import required

        if "lr" not in rule.hyper:
            raise TypeError(f"rule {rule.name!r} has no lr: a torch optimizer's param groups "
                            f"(and LR schedulers) drive the rule's lr hyperparameter; declare one")
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
        super().__init__(params, defaults, flat_grads)

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
                 flat_grads=False):
        check_adam_args(lr, betas, 0.0, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay), flat_grads)

    def _rule(self, group):
        return library.lion()

    def _rule_hyper(self, group) -> dict:
        beta1, beta2 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"])


class Adan(RuleBased):
    """Adan (`mtapply.rules.library.adan`, optax.adan's update) with the arguments of the
    authors' PyTorch implementation: betas=(beta1, beta2, beta3), eps, weight_decay (decoupled:
    p -= lr * (update + weight_decay * p)). State: `m`, `v`, `n`, `prev_grad`, `step`."""

    _OPTION_NAMES = BETA_NAMES

    def __init__(self, params, lr=1e-3, betas=(0.98, 0.92, 0.99), eps=1e-8, weight_decay=0.0,
                 *, flat_grads=False):
        check_options(lr=lr, eps=eps, weight_decay=weight_decay)
        for k, beta in enumerate(betas):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"Invalid beta parameter at index {k}: {beta}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay), flat_grads)

    def _rule(self, group):
        return library.adan()

    def _rule_hyper(self, group) -> dict:
        beta1, beta2, beta3 = group["betas"]
        return dict(lr=group["lr"], beta1=beta1, beta2=beta2, beta3=beta3, eps=group["eps"],
                    eps_root=0.0, weight_decay=group["weight_decay"])


class ScheduleFreeAdamW(RuleBased):
    """Schedule-free AdamW (`mtapply.rules.library.schedule_free_adamw`) with the update of
    optax.contrib.schedule_free_adamw and the arguments and train()/eval() of the authors'
    AdamWScheduleFree: the params hold y while training; `eval()` puts the average x in them
    and `train()` puts y back. Per group, the running max lr, the sum of the averaging weights
    and the steps taken are host numbers in the group (saved with state_dict); each param's
    state holds `z` (a copy of the param at first), `nu` and `step`. lr is a number (the weights
    are computed on the host: a tensor lr is read there at each step, which costs a CUDA one a
    synchronisation); a step skipped by GradScaler still advances them."""

    _merges_groups = False  # its per-group running values live in each group

    def __init__(self, params, lr=0.0025, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 warmup_steps=0, weight_lr_power=2.0, *, flat_grads=False):
        check_options(lr=lr, eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps)
        if not 0.0 < betas[0] < 1.0 or not 0.0 <= betas[1] < 1.0:
            raise ValueError(f"Invalid betas: {betas} (beta1 in (0, 1), beta2 in [0, 1))")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        warmup_steps=warmup_steps, weight_lr_power=weight_lr_power,
                        lr_max=0.0, weight_sum=0.0, k=0, train_mode=True)
        super().__init__(params, defaults, flat_grads)

    def _rule(self, group):
        return library.schedule_free_adamw()

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
        if bound is None:
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
                z = self.state.get(p, {}).get("z")
                if z is not None:  # y = b1 x + (1 - b1) z, both ways as a lerp towards z
                    p.lerp_(z, 1 - beta1 if to_train else 1 - 1 / beta1)
            group["train_mode"] = to_train


class AdamFamily(RuleBased):
    """Rule-run optimizers of torch.optim's Adam family: `betas` as the rule's beta1 and
    beta2, each other hyperparameter the group option of its name."""

    _OPTION_NAMES = BETA_NAMES

    def _start(self, params, flat_grads, lr, betas, eps, weight_decay, **options) -> None:
        """The optimizer, its defaults the family's shared arguments and `options` (the class's
        own and torch.optim's flags), after the class checked them as torch.optim does."""
        RuleBased.__init__(self, params, dict(lr=lr, betas=betas, eps=eps,
                                              weight_decay=weight_decay, **options), flat_grads)

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
                 flat_grads=False):
        check_adam_args(lr, betas, eps, weight_decay)
        self._start(params, flat_grads, lr, betas, eps, weight_decay, foreach=foreach,
                    maximize=maximize, differentiable=differentiable, capturable=capturable)

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
                 maximize=False, capturable=False, differentiable=False, flat_grads=False):
        check_adam_args(lr, betas, eps, weight_decay)
        if not 0.0 <= momentum_decay:
            raise ValueError(f"Invalid momentum_decay value: {momentum_decay}")
        self._start(params, flat_grads, lr, betas, eps, weight_decay,
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
                 capturable=False, differentiable=False, flat_grads=False):
        check_adam_args(lr, betas, eps, weight_decay)
        self._start(params, flat_grads, lr, betas, eps, weight_decay,
                    decoupled_weight_decay=decoupled_weight_decay, foreach=foreach,
                    maximize=maximize, capturable=capturable, differentiable=differentiable)

    def _rule(self, group):
        return library.radam(bool(group["decoupled_weight_decay"]), bool(group["maximize"]))


class Adadelta(RuleBased):
    """`torch.optim.Adadelta` (same arguments and state: `square_avg`, `acc_delta`, `step`) from
    `mtapply.rules.library.adadelta`; `foreach`, `capturable` and `differentiable=False` are
    accepted for compatibility."""

    def __init__(self, params, lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.0, foreach=None, *,
                 capturable=False, maximize=False, differentiable=False, flat_grads=False):
        check_options(lr=lr, eps=eps, weight_decay=weight_decay)
        if not 0.0 <= float(rho) <= 1.0:
            raise ValueError(f"Invalid rho value: {rho}")
        defaults = dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, foreach=foreach,
                        capturable=capturable, maximize=maximize, differentiable=differentiable)
        super().__init__(params, defaults, flat_grads)

    def _rule(self, group):
        return library.adadelta(bool(group["maximize"]))


class Adagrad(RuleBased):
    """`torch.optim.Adagrad` (same arguments and state: `sum`, `step`) from
    `mtapply.rules.library.adagrad`; `foreach`, `fused` and `differentiable=False` are accepted
    for compatibility. Params with sparse grads take torch.optim's own per-tensor update, as
    SGD's do."""

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0,
                 initial_accumulator_value=0.0, eps=1e-10, foreach=None, *, maximize=False,
                 differentiable=False, fused=None, flat_grads=False):
        check_options(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                       initial_accumulator_value=initial_accumulator_value, eps=eps)
        defaults = dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach,
                        maximize=maximize, differentiable=differentiable, fused=fused)
        super().__init__(params, defaults, flat_grads)

    _sparse_grads = True

    def _rule(self, group):
        return library.adagrad(bool(group["maximize"]))

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

    def __init__(self, params, lr=1e-2, alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0,
                 centered=False, capturable=False, foreach=None, maximize=False,
                 differentiable=False, *, flat_grads=False):
        check_options(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                       momentum=momentum)
        defaults = dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay,
                        momentum=momentum, centered=centered, capturable=capturable,
                        foreach=foreach, maximize=maximize, differentiable=differentiable)
        super().__init__(params, defaults, flat_grads)

    def _rule(self, group):
        return library.rmsprop(bool(group["centered"]), group["momentum"] > 0,
                               bool(group["maximize"]))

    def _check_group(self, index: int, group) -> None:
        super()._check_group(index, group)  # momentum too, where it is above 0
        check_number(f"param group {index}: momentum", group["momentum"], low=0.0)

    def _required_state(self, group, param) -> tuple:
        return ("step", "square_avg")  # grad_avg, momentum_buffer start when their options do


def optimizer(rule, params, *, flat_grads=False, **hyper) -> RuleOptimizer:
    """`rule` (from `mtapply.rule`) as a torch.optim.Optimizer over `params` (params or param
    groups), with the rule's hyperparameters as options: param groups, state_dict, LR
    schedulers, GradScaler and `flat_grads` as the built-in optimizers have them.

    Example:
        >>> opt = mtapply.torch.optimizer(lion, model.parameters(), lr=1e-4, weight_decay=0.1)
    """
    return RuleOptimizer(rule, params, flat_grads=flat_grads, **hyper)
