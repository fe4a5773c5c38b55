"""`mtapply.torch.Adafactor`: torch.optim.Adafactor run by the rule `library.adafactor`, whose
second moment is factored (row and column vectors) for params of two or more dimensions."""
from __future__ import annotations

import math

import torch

from ._torch_checks import check_adafactor_args
from ._torch_rules import RuleBased
from .rules import library

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


class Adafactor(RuleBased):
    """`torch.optim.Adafactor` (same arguments, defaults and state: `row_var` and `col_var`,
    shaped (..., rows, 1) and (..., 1, cols), for params of two or more dimensions, `variance`
    for the others, and `step`), so checkpoints move between the two both ways. `eps[0]`
    None is the machine epsilon of the group's first param's dtype (that of its first param
    with a grad), as torch.optim takes it. `foreach` is accepted for compatibility. On a GPU
    the row and column means are reductions before the update (kernels/factored.cuh)."""

    _UNSIGNED_STATE = ("row_var", "col_var", "variance")
    _OPTION_NAMES = {"eps1": "eps[0]", "eps2": "eps[1]"}

    def __init__(self, params, lr=1e-2, beta2_decay=-0.8, eps=(None, 1e-3), d=1.0,
                 weight_decay=0.0, *, foreach=None, maximize=False, flat_grads=False):
        check_adafactor_args(lr, beta2_decay, eps, d, weight_decay)
        defaults = dict(lr=lr, beta2_decay=beta2_decay, eps=tuple(eps), d=d,
                        weight_decay=weight_decay, foreach=foreach, maximize=maximize)
        super().__init__(params, defaults, flat_grads)

    def _rule(self, group):
        return library.adafactor(bool(group["maximize"]))

    def _rule_hyper(self, group) -> dict:
        eps1, eps2 = group["eps"]
        return dict(lr=_finite(group["lr"]), beta2_decay=group["beta2_decay"],
                    eps1=self._machine_epsilon(group) if eps1 is None else eps1, eps2=eps2,
                    d=_finite(group["d"]), weight_decay=group["weight_decay"])

    @staticmethod
    def _machine_epsilon(group) -> float:
        params = group["params"]
        first = next((p for p in params if p.grad is not None), params[0] if params else None)
        dtype = first.dtype if first is not None and first.is_floating_point() else torch.float32
        return float(torch.finfo(dtype).eps)

    def _check_entry(self, group, param, entry, where) -> None:
        super()._check_entry(group, param, entry, where)
        for name, shape in _state_shapes(param.shape).items():
            value = entry.get(name)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != shape:
                raise ValueError(f"{where()} holds {name!r} of shape {tuple(value.shape)}, but a "
                                 f"param of shape {tuple(param.shape)} keeps it as {shape}: load "
                                 f"a state saved for a param of this shape, or give the param an "
                                 f"empty state (optimizer.state[p] = {{}}) to start it afresh")

    def _check_group(self, index: int, group) -> None:
        eps = group["eps"]
        if not isinstance(eps, (tuple, list)) or len(eps) != 2:
            raise ValueError(f"param group {index}: eps must be a pair (eps1 or None, eps2), "
                             f"got {eps!r}")
        super()._check_group(index, group)

    def _prepare_group(self, index, group):
        # at the step, in torch.optim's words; merged groups are bound together, each of the
        # caller's groups named as it is
        for g, own in enumerate(self.param_groups) if index == "merged" else [(index, group)]:
            for i, p in enumerate(own["params"]):
                if p.is_complex() and p.grad is not None:
                    raise RuntimeError(f"Adafactor does not support complex parameters: param "
                                       f"{i} of param group {g} is {p.dtype}")
        return super()._prepare_group(index, group)


def _state_shapes(shape) -> dict:
    """torch.optim.Adafactor's state shapes for a param of `shape`: the row and column
    vectors of a factored one (two or more dimensions), else a full variance."""
    shape = tuple(shape)
    if len(shape) >= 2:
        return {"row_var": shape[:-1] + (1,), "col_var": shape[:-2] + (1, shape[-1])}
    return {"variance": shape}


def _finite(value):
    """+inf, which torch.optim.Adafactor takes as lr (the relative step min(lr, 1 / sqrt(t)) is
    then 1 / sqrt(t)) and as d (no clipping: RMS(u) / d is 0), as the largest float32: the
    same steps for any finite update, with the kernels' hyperparameters finite float32s."""
    return _FLOAT32_MAX if not isinstance(value, torch.Tensor) and value == math.inf else value
