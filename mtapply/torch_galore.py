"""`mtapply.torch.GaLoreAdamW`: galore-torch's GaLoreAdamW (param groups with `rank`) on
mtapply's GaLore steps (`mtapply.galore`)."""
from __future__ import annotations

import torch

from . import galore
from .galore import PROJECTION_TYPES, Projection, projection_side


class GaLoreAdamW(torch.optim.Optimizer):
    """galore-torch's `GaLoreAdamW` on mtapply's kernels. Param groups with `rank` (and
    optionally `update_proj_gap` (200), `scale` (1.0), `proj_type` ("std", "reverse_std",
    "left", "right")) project their 2-D params; their 1-D params and groups without `rank` get
    plain AdamW of the same form (`mtapply.galore`). State per projected param: `step`,
    `exp_avg` and `exp_avg_sq` of the projected shape, `ortho` (the projector) and `left`
    (True: R = ortho^T G; False: R = G ortho^T; a bool, since torch's load_state_dict would
    mangle a string)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 correct_bias=True):
        galore.check_options(lr, weight_decay, eps, betas)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias))
        self._projections: dict = {}  # param -> its Projection (projector and work buffers)
        self._plans = galore.BufferPlans()

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if "rank" in group:
            galore.check_options(group["lr"], group["weight_decay"], group["eps"], group["betas"],
                                 group["rank"], group.get("update_proj_gap", 200))
            if group.get("proj_type", "std") not in PROJECTION_TYPES:
                raise ValueError(f"proj_type {group.get('proj_type')!r}: use one of "
                                 f"{', '.join(PROJECTION_TYPES)}")

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._plans = galore.BufferPlans()  # the plans' moments are the replaced ones

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            projected, plain = {}, {}  # step count -> the params stepped with it
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
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
            options = dict(lr=group["lr"], betas=group["betas"], eps=group["eps"],
                           weight_decay=group["weight_decay"], correct_bias=group["correct_bias"])
            for step, params in projected.items():
                galore.project_all([p.grad for p in params], [self._projections[p] for p in params],
                                   self._plans.products)
                galore.step_projected(params, [self._projections[p] for p in params],
                                      *self._moments(params), step=step,
                                      scale=group.get("scale", 1.0), plans=self._plans,
                                      **options)
            for step, params in plain.items():
                galore.step_plain(params, [p.grad for p in params], *self._moments(params),
                                  step=step, **options)
        return loss

    def _project(self, group, p, state, step: int) -> None:
        """The projector and the buffers of R and N; a fresh projector every update_proj_gap steps
        (or the one a loaded state_dict holds)."""
        projection = self._projections.get(p)
        if projection is None or projection.ortho is not state.get("ortho"):
            projection = self._projections[p] = Projection(state.get("left", False),
                                                           state.get("ortho"))
        if projection.ortho is None or step % group.get("update_proj_gap", 200) == 0:
            projection.left = projection_side(p.shape, group.get("proj_type", "std")) == "left"
            projection.refresh(p.grad, group["rank"])
            state["ortho"], state["left"] = projection.ortho, projection.left
        projection.make_buffers(p.grad)
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(projection.projected)
            state["exp_avg_sq"] = torch.zeros_like(projection.projected)

    def _moments(self, params) -> tuple:
        return ([self.state[p]["exp_avg"] for p in params],
                [self.state[p]["exp_avg_sq"] for p in params])


__all__ = ["GaLoreAdamW"]
