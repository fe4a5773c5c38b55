"""How torch's machinery around `Optimizer.step` sees mtapply's torch optimizers.

torch.optim wraps every `Optimizer.step` in a profiler range and its hook calls, which it enters
even when no profiler runs and no hook is registered: tens of microseconds of host work on a
step whose own host work is a few launches. `lean_step()` makes a `step` that goes through that
wrapper only when a profiler or a hook is there, and otherwise calls `self._plain_step` alone.

`AmpScaling` answers GradScaler and the libraries that ask whether a step unscales its grads
itself (`_step_supports_amp_scaling`).

`bump_versions(params)` does for the params a step wrote what torch's in-place ops do: it moves
their version counters, so that autograd refuses a backward through a graph that saved a param
before the step (one call of mtapply's compiled torch library, about 6 ns a param; torch's own
call, about 40, until it is built or where it cannot be).
"""
from __future__ import annotations

import ctypes
import sys

import torch

from ._describe import native_function

_GRAD_SCALER = "torch.amp.grad_scaler"  # the module of GradScaler.step (torch.cuda's derives)


def closure_loss(closure):
    """The loss of torch.optim's `step(closure)`: the closure evaluated with grad enabled."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def lean_step():
    """A `step(self, closure=None)` method calling `self._plain_step(closure)`."""
    profiler_enabled = torch._C._autograd._profiler_enabled
    module = sys.modules[torch.optim.Optimizer.__module__]  # holds the global hooks

    def plain(self, closure=None):
        return self._plain_step(closure)

    hooked = torch.optim.Optimizer.profile_hook_step(plain)

    def step(self, closure=None):
        if (profiler_enabled() or self._optimizer_step_pre_hooks
                or self._optimizer_step_post_hooks or module._global_optimizer_pre_hooks
                or module._global_optimizer_post_hooks):
            return hooked(self, closure)
        return self._plain_step(closure)

    step.hooked = True  # torch.optim leaves a step so marked unwrapped
    return step


class AmpScaling:
    """`_step_supports_amp_scaling` of an optimizer whose step takes GradScaler's scale and
    inf flag (its kernels read them on the device: no host synchronisation), and takes just
    as well grads that `GradScaler.unscale_` unscaled (GradScaler.step then passes no scale):
    True where GradScaler.step asks, False for any other reader. Lightning's precision plugins
    read it to refuse gradient clipping for "fused" optimizers (torch's unscale only inside
    their step) and otherwise unscale before clipping, which suits this step too; so
    `scaler.unscale_(opt); clip_grad_norm_(...); scaler.step(opt)` runs without a host sync
    under Lightning's 16-mixed as in a plain loop."""

    def __get__(self, optimizer, owner=None) -> bool:
        if optimizer is None:
            return True  # on the class: the step supports AMP scaling
        return sys._getframe(1).f_globals.get("__name__") == _GRAD_SCALER


def _version_bumper():
    bump = torch._C._increment_version
    try:
        bump([])  # torch >= 2.6 takes a list in one call
        return bump
    except TypeError:  # an older torch takes one tensor at a time
        return lambda tensors: [bump(t) for t in tensors]


_torch_bump = _version_bumper()
_BUMP_ARGS = [ctypes.py_object] * 3


def bump_versions(tensors) -> None:
    native = native_function("mta_bump_versions", _BUMP_ARGS)
    if native is None or native(tensors, torch.Tensor, torch.nn.Parameter) < 0:
        _torch_bump(tensors)  # (a list the library refused part way moves some versions twice)
