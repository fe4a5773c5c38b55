"""GaLore AdamW (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection") on mtapply's fused Adam: `mtapply.torch.GaLoreAdamW`.

Each 2-D param of a group with a `rank` keeps Adam moments of rank r: its grad G (m x n) is
projected, R = P^T G (P: m x r) or R = G Q^T (Q: r x n), the projector coming from an SVD of G
every `update_proj_gap` steps; Adam runs on R, and the normalized step goes back through the
projector into the param. Per step: a matmul per matrix for the projections, one mtapply launch
for the Adam steps of all projected grads (which writes the normalized steps), one per group for
the plain params, and a matmul per matrix that writes the param itself (weight decay folded into
its beta). The update is galore-torch's AdamW (`mtapply.reference.galore_adamw`): eps outside the
root of the uncorrected second moment, weight decay applied to the updated param.
"""
from __future__ import annotations

import math

import torch

from . import _calls
from .ops.adam import AdamSpec

PROJECTION_TYPES = ("std", "reverse_std", "left", "right")
_NO_BIAS_CORRECTION = 1e9  # a step count whose bias corrections are 1 in double precision


def projection_side(shape, proj_type: str) -> str:
    """"left" (R = P^T G) or "right" (R = G Q^T) for a matrix of `shape`, as galore-torch
    chooses: "std" projects the longer side away, "reverse_std" the shorter."""
    rows, cols = shape
    if proj_type == "std":
        return "right" if rows >= cols else "left"
    if proj_type == "reverse_std":
        return "left" if rows >= cols else "right"
    return proj_type


def orthogonal_projector(grad: torch.Tensor, rank: int, side: str) -> torch.Tensor:
    """The first `rank` left (m x r) or right (r x n) singular vectors of the grad (all of them
    where the matrix has fewer, as galore-torch takes them)."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    ortho = u[:, :rank] if side == "left" else vh[:rank, :]
    return ortho.to(grad.dtype).contiguous()


class GaLoreAdamW(torch.optim.Optimizer):
    """galore-torch's `GaLoreAdamW` on mtapply's kernels. Param groups with `rank` (and
    optionally `update_proj_gap` (200), `scale` (1.0), `proj_type` ("std", "reverse_std",
    "left", "right")) project their 2-D params; their 1-D params and groups without `rank` get
    plain AdamW of the same form. State per projected param: `step`, `exp_avg` and `exp_avg_sq`
    of the projected shape, `ortho` (the projector) and `left` (True: R = ortho^T G; False:
    R = G ortho^T; a bool, since torch's load_state_dict would mangle a string)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 correct_bias=True):
        if lr < 0.0 or eps < 0.0 or weight_decay < 0.0 or lr * weight_decay >= 1.0:
            raise ValueError(f"Invalid lr={lr}, eps={eps} or weight_decay={weight_decay} "
                             f"(each >= 0, lr * weight_decay < 1)")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      correct_bias=correct_bias))
        for group in self.param_groups:
            _check_group(group)
        self._work: dict = {}  # param -> (projected grad, normalized step) buffers

    def add_param_group(self, param_group) -> None:
        super().add_param_group(param_group)
        _check_group(self.param_groups[-1])

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
            for step, params in projected.items():
                self._step_projected(group, params, step)
            for step, params in plain.items():
                self._step_plain(group, params, step)
        return loss

    def _project(self, group, p, state, step: int) -> None:
        """The projected grad into its buffer; a fresh projector every update_proj_gap steps."""
        if "ortho" not in state or step % group.get("update_proj_gap", 200) == 0:
            side = projection_side(p.shape, group.get("proj_type", "std"))
            state["ortho"] = orthogonal_projector(p.grad, group["rank"], side)
            state["left"] = side == "left"
        ortho, left = state["ortho"], state["left"]
        shape = (ortho.shape[1], p.shape[1]) if left else (p.shape[0], ortho.shape[0])
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
            state["exp_avg_sq"] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        work = self._work.get(p)
        if work is None or work[0].shape != shape:
            work = self._work[p] = (torch.empty(shape, dtype=p.dtype, device=p.device),
                                    torch.empty(shape, dtype=p.dtype, device=p.device))
        if left:
            torch.matmul(ortho.t(), p.grad, out=work[0])
        else:
            torch.matmul(p.grad, ortho.t(), out=work[0])

    def _step_projected(self, group, params: list, step: int) -> None:
        """One launch writes every matrix's normalized step (-step_size * m / (sqrt(v) + eps));
        then each param becomes (p + scale * back(step)) * (1 - lr * weight_decay), one GEMM."""
        work = [self._work[p] for p in params]
        _calls.step(_NORMALIZED_STEP, {"params": [w[1] for w in work],
                                       "grads": [w[0] for w in work],
                                       "exp_avgs": [self.state[p]["exp_avg"] for p in params],
                                       "exp_avg_sqs": [self.state[p]["exp_avg_sq"] for p in params]},
                    **_adam_arguments(group, step, group["lr"], 0.0))
        decay = 1.0 - group["lr"] * group["weight_decay"]
        alpha = decay * group.get("scale", 1.0)
        for p, (_, normalized) in zip(params, work):
            ortho = self.state[p]["ortho"]
            if self.state[p]["left"]:
                p.addmm_(ortho, normalized, beta=decay, alpha=alpha)
            else:
                p.addmm_(normalized, ortho, beta=decay, alpha=alpha)

    def _step_plain(self, group, params: list, step: int) -> None:
        # (p - u) * (1 - lr * wd) = p * (1 - lr * wd) - u * (1 - lr * wd): mtapply's AdamW with
        # the step scaled by 1 - lr * wd and the decay rate divided by it
        decay = 1.0 - group["lr"] * group["weight_decay"]
        _calls.step(_ADAMW, {"params": params, "grads": [p.grad for p in params],
                             "exp_avgs": [self.state[p]["exp_avg"] for p in params],
                             "exp_avg_sqs": [self.state[p]["exp_avg_sq"] for p in params]},
                    **_adam_arguments(group, step, group["lr"] * decay,
                                      group["weight_decay"] / decay))


_ADAMW = AdamSpec(decoupled_weight_decay=True)
_NORMALIZED_STEP = _ADAMW.with_param_mode("zero")  # writes the step into `params`


def _adam_arguments(group, step: int, lr: float, weight_decay: float) -> dict:
    """mtapply Adam's arguments for galore-torch's form: its eps is added to sqrt(v) before
    the bias correction, which is mtapply's eps divided by sqrt(1 - beta2**t)."""
    beta1, beta2 = group["betas"]
    if not group["correct_bias"]:
        return dict(lr=lr, step=_NO_BIAS_CORRECTION, beta1=beta1, beta2=beta2,
                    eps=group["eps"], weight_decay=weight_decay)
    return dict(lr=lr, step=float(step), beta1=beta1, beta2=beta2,
                eps=group["eps"] / math.sqrt(1.0 - beta2 ** step), weight_decay=weight_decay)


def _check_group(group) -> None:
    if "rank" not in group:
        return
    if not isinstance(group["rank"], int) or group["rank"] < 1:
        raise ValueError(f"rank must be a positive integer, got {group['rank']!r}")
    if group.get("proj_type", "std") not in PROJECTION_TYPES:
        raise ValueError(f"proj_type {group.get('proj_type')!r}: use one of "
                         f"{', '.join(PROJECTION_TYPES)}")
    if group.get("update_proj_gap", 200) < 1:
        raise ValueError(f"update_proj_gap must be >= 1, got {group['update_proj_gap']}")


__all__ = ["GaLoreAdamW", "PROJECTION_TYPES", "orthogonal_projector", "projection_side"]
