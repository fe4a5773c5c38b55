"""`mtapply.torch.GaLoreAdamW`: galore-torch's GaLoreAdamW (param groups with `rank`) on
mtapply's GaLore steps (`mtapply.galore`)."""
from __future__ import annotations

import operator

import torch

from . import galore
from ._optimizer_step import bump_versions, closure_loss, lean_step
from ._torch_layouts import PlanLists
from ._torch_state import StateKeeping
from .galore import PROJECTION_TYPES, Projection, projection_side
from .ops._spec import check_number


class GaLoreAdamW(StateKeeping, torch.optim.Optimizer):
    """galore-torch's `GaLoreAdamW` on mtapply's kernels. Param groups with `rank` (and
    optionally `update_proj_gap` (200), `scale` (1.0), `proj_type` ("std", "reverse_std",
    "left", "right")) project their 2-D params; their 1-D params and groups without `rank` get
    plain AdamW of the same form (`mtapply.galore`). State per projected param: `step`,
    `exp_avg` and `exp_avg_sq` of the projected shape, `ortho` (the projector) and `left`
    (True: R = ortho^T G; False: R = G ortho^T; a bool, since torch's load_state_dict would
    mangle a string). `step` is a number, as galore-torch keeps it.

    Every group's options are checked before a step moves anything (step counts, projectors,
    params). `lr` may be a one-element tensor, read on the host at each step (its GEMMs take
    host scalars): a CPU tensor costs no synchronisation, a CUDA one waits for its value.
    Complex params step as torch.optim steps them, viewed as real, in groups without `rank`;
    a group with `rank` refuses complex matrices (their projection would need a complex SVD).
    Params that are not dense (a strided view) step through a dense copy (as `mtapply.torch`'s
    other optimizers; projected ones directly)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 correct_bias=True):
        galore.check_options(_host_lr(lr), weight_decay, eps, betas)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias))
        self._keep_state()
        self._projections: dict = {}  # param -> its Projection (projector and work buffers)
        self._steps = galore.ProjectedSteps()
        self._bound: dict = {}  # group index -> its _BoundGroup
        self._version = 0  # moves on wherever the state may change under the bound groups

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        self._version = getattr(self, "_version", 0) + 1  # (torch's __init__ comes here first)
        _check_group(len(self.param_groups) - 1, self.param_groups[-1])

    def __setstate__(self, state) -> None:  # copy.deepcopy and pickle keep only torch's fields
        super().__setstate__(state)  # load_state_dict comes here too, with new groups
        for group in self.param_groups:  # an older pickle's groups
            self._fill_group(group)
        self._keep_state()
        self._projections, self._steps, self._bound = {}, galore.ProjectedSteps(), {}
        self._version = getattr(self, "_version", 0) + 1

    def _required_state(self, group, param) -> tuple:
        if "rank" in group and param.dim() == 2:
            return ("step", "exp_avg", "exp_avg_sq", "ortho", "left")
        return ("step", "exp_avg", "exp_avg_sq")

    step = lean_step()  # torch.optim's wrapper only where a profiler or a hook needs it

    def _plain_step(self, closure=None):
        loss = closure_loss(closure)
        with torch.no_grad():
            for index, group in enumerate(self.param_groups):  # before anything moves
                _check_group(index, group)
            self._grouped_steps()
        return loss

    def _grouped_steps(self) -> None:
        if self._state_moved():  # the bound steps hold the replaced moments and step counts
            self._steps = galore.ProjectedSteps()
            self._version += 1
        for index, group in enumerate(self.param_groups):
            bound = self._bound.get(index)
            if bound is None or not bound.step(group, self._version):
                self._bound[index] = self._unbound_step(group)
        self._state_kept()

    def _unbound_step(self, group) -> _BoundGroup | None:
        """A step that looks at every param (and refreshes the projectors that are due);
        returns the group's step bound for the next steps where every param has a grad and
        one step count."""
        projected, plain = {}, {}  # step count -> the params stepped with it
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if state:
                self._check_entry(group, p, state, lambda p=p: f"optimizer.state of param "
                                  f"{_index_in(group['params'], p)} of its group")
            step = state.get("step", 0)
            if "rank" in group and p.dim() == 2:
                self._project(group, p, state, step)
                projected.setdefault(step + 1, []).append(p)
            else:
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                plain.setdefault(step + 1, []).append(p)
            state["step"] = step + 1
        options = _options(group)
        for step, params in projected.items():
            projections = [self._projections[p] for p in params]
            bound = self._steps.get(params, projections, *self._moments(params))
            bound.run([p.grad for p in params], step=step, scale=group.get("scale", 1.0),
                      **options)
        for step, params in plain.items():
            self._step_plain(params, [p.grad for p in params], step, options)
        for params in (*projected.values(), *plain.values()):
            bump_versions(params)
        counts = set(projected) | set(plain)
        stepped = sum(map(len, projected.values())) + sum(map(len, plain.values()))
        if len(counts) != 1 or stepped != len(group["params"]):
            return None
        (count,) = counts
        return _BoundGroup(group["params"], [self.state[p] for p in group["params"]], count,
                           projected.get(count, []), bound if projected else None,
                           plain.get(count, []), self._step_plain, self._version)

    def _step_plain(self, params: list, grads: list, step: int, options: dict) -> None:
        """galore's plain AdamW over params of any layout torch.optim steps (complex as real,
        a param that is not dense through a dense stand-in: `mtapply._torch_layouts`)."""
        lists = PlanLists(self.state, params, grads)
        if lists.staging:
            lists.staging.before(grads)
        galore.step_plain(lists.bound, lists.grads, lists.state("exp_avg"),
                          lists.state("exp_avg_sq"), step=step, **options)
        if lists.staging:
            lists.staging.after()

    def _project(self, group, p, state, step: int) -> None:
        """The projector and the buffers of R and N; a fresh projector every update_proj_gap steps
        (or the one a loaded state_dict holds)."""
        projection = self._projections.get(p)
        if projection is None or projection.ortho is not state.get("ortho"):
            projection = self._projections[p] = Projection(state.get("left", False),
                                                           state.get("ortho"))
            if projection.ortho is not None:
                projection.make_buffers(p.grad)
        if projection.ortho is None or step % group.get("update_proj_gap", 200) == 0:
            projection.left = projection_side(p.shape, group.get("proj_type", "std")) == "left"
            projection.refresh(p.grad, group["rank"])
            state["ortho"], state["left"] = projection.ortho, projection.left
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(projection.projected)
            state["exp_avg_sq"] = torch.zeros_like(projection.projected)

    def _moments(self, params) -> tuple:
        return ([self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params])


def _index_in(params: list, p) -> int:
    return next(i for i, q in enumerate(params) if q is p)


def _options(group) -> dict:
    return {"lr": _host_lr(group["lr"]), "betas": group["betas"], "eps": group["eps"],
            "weight_decay": group["weight_decay"], "correct_bias": group["correct_bias"]}


def _host_lr(lr):
    """The lr as a number: a one-element tensor's value, read on the host."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError("Tensor lr must be 1-element")
        return float(lr)
    return lr


def _check_group(index: int, group) -> None:
    """A group's options, named as the user gave them, before a step moves anything."""
    where = f"param group {index}: "
    try:
        lr = _host_lr(group["lr"])
    except ValueError as error:
        raise ValueError(f"{where}{error}") from None
    projected = "rank" in group
    galore.check_options(lr, group["weight_decay"], group["eps"], group["betas"],
                         group["rank"] if projected else None,
                         group.get("update_proj_gap", 200), where)
    if not projected:
        return
    if group.get("proj_type", "std") not in PROJECTION_TYPES:
        raise ValueError(f"{where}proj_type {group.get('proj_type')!r}: use one of "
                         f"{', '.join(PROJECTION_TYPES)}")
    check_number(f"{where}scale", group.get("scale", 1.0))
    for i, p in enumerate(group["params"]):
        if p.dim() == 2 and p.is_complex():
            raise ValueError(f"{where}param {i} is a complex matrix, which GaLore cannot "
                             f"project (its projector is a real SVD): put it in a group "
                             f"without rank, where it steps as torch.optim steps complex params")


class _BoundGroup:
    """A group's step while its params stay, each has a grad, all share one step count, no
    projector is due for a refresh and the optimizer's state is not replaced (`version`): the
    grads are read, the step counts written, and the bound steps run."""

    def __init__(self, params: list, states: list, count: int, projected: list, bound,
                 plain: list, step_plain, version: int):
        self.params, self.states, self.count, self.version = list(params), states, count, version
        self.projected, self.bound = projected, bound
        self.plain, self.step_plain = plain, step_plain
        projected_ids = set(map(id, projected))  # (both lists follow the group's order)
        self.projected_at = [k for k, p in enumerate(params) if id(p) in projected_ids]
        self.plain_at = [k for k, p in enumerate(params) if id(p) not in projected_ids]

    def step(self, group, version: int) -> bool:
        """One step, or False (and nothing done) where the bound step no longer fits."""
        params = group["params"]
        if (version != self.version or len(params) != len(self.params)
                or not all(map(operator.is_, params, self.params))
                or (self.projected and self.count % group.get("update_proj_gap", 200) == 0)):
            return False
        grads = [p.grad for p in params]
        if any(grad is None for grad in grads):
            return False
        self.count += 1
        for state in self.states:
            state["step"] = self.count
        options = _options(group)
        if self.projected:
            self.bound.run([grads[k] for k in self.projected_at], step=self.count,
                           scale=group.get("scale", 1.0), **options)
        if self.plain:
            self.step_plain(self.plain, [grads[k] for k in self.plain_at], self.count, options)
        bump_versions(self.params)
        return True


__all__ = ["GaLoreAdamW"]
