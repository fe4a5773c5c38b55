"""A `step` for torch optimizers without torch.optim's per-call wrapper.

torch.optim wraps every `Optimizer.step` in a profiler range and its hook calls, which it enters
even when no profiler runs and no hook is registered: tens of microseconds of host work on a
step whose own host work is a few launches. `lean_step()` makes a `step` that goes through that
wrapper only when a profiler or a hook is there, and otherwise calls `self._plain_step` alone.

`bump_versions(params)` does for the params a step wrote what torch's in-place ops do: it moves
their version counters, so that autograd refuses a backward through a graph that saved a param
before the step (one C call, about 40 ns a param on a CPU).
"""
from __future__ import annotations

import sys

import torch


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


def _version_bumper():
    bump = torch._C._increment_version
    try:
        bump([])  # torch >= 2.6 takes a list in one call
        return bump
    except TypeError:  # an older torch takes one tensor at a time
        return lambda tensors: [bump(t) for t in tensors]


bump_versions = _version_bumper()
