"""torch tensors of every layout torch.optim steps, as mtapply's plans take them.

A plan walks dense memory of a real floating dtype, in any dimension order (channels_last
included), each slot of a param laid out as the param. torch.optim also steps:

- complex params: their params, grads and states are viewed as real (`torch.view_as_real`),
  as torch.optim views them, so the elementwise update is the same (Adam's second moment, as
  torch.optim's, is kept per real and imaginary part); a norm over a tensor (LARS, LAMB) is
  then the norm of its complex values, |z|^2 = re^2 + im^2, and 8-bit blocks span both parts.
- params that are not dense (a strided view such as `w[:, ::2]`): the plan steps a row-major
  stand-in, copied from the param before the step's launches and back after them, on torch's
  current stream (the launch stream). A slow path: two copies per such param per step.
- grads laid out unlike their param (autograd gives the param's layout, or the contiguous one
  for a param that is not dense; a grad assigned by hand may differ): copied each step into a
  stand-in of the param's layout, which the plan reads.

States are made with `torch.preserve_format` (the param's layout where it is dense); a state
of another layout than the plan's (loaded, or made for a param that is not dense) is copied
once into the plan's layout and kept so.
"""
from __future__ import annotations

import types

import torch

from ._dlpack import is_dense as _is_dense_ref
from ._dlpack import row_major_strides
from ._dtensor import shard_scales

_IS_COMPLEX = torch.Tensor.is_complex


def is_dense(tensor) -> bool:
    """Whether a tensor covers exactly its numel consecutive elements, in some dimension order."""
    return tensor.is_contiguous() or _is_dense_ref(types.SimpleNamespace(
        row_major=False, numel=tensor.numel(), strides=tensor.stride(), shape=tuple(tensor.shape)))


def dense_strides(tensor) -> tuple:
    """The strides a plan steps a param with: its own where it is dense, else row-major."""
    return tensor.stride() if is_dense(tensor) else row_major_strides(tuple(tensor.shape))


def as_real(tensor):
    """A complex tensor viewed as real (a trailing dimension of 2); any other as it is."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


def as_reals(tensors: list) -> list:
    """`as_real` of each (the list itself where none is complex: a C-level scan)."""
    return list(map(as_real, tensors)) if any(map(_IS_COMPLEX, tensors)) else tensors


def same_layout(a, b) -> bool:
    """Whether two tensors of one shape lay their elements out alike (size-1 dimensions,
    whose strides mean nothing, aside)."""
    if a.stride() == b.stride() or a.numel() <= 1:
        return True
    return ([s for s, n in zip(a.stride(), a.shape) if n != 1]
            == [s for s, n in zip(b.stride(), b.shape) if n != 1])


class Staging:
    """The stand-ins of one plan's tensors (see the module docstring): `param`, `grad` and
    `state` give what the plan binds; `before` and `after` copy around each step's launches."""

    def __init__(self):
        self.params: list = []  # (param, its dense stand-in)
        self.grads: dict = {}  # index in the plan -> the stand-in its grads are copied into

    def __bool__(self) -> bool:
        return bool(self.params or self.grads)

    def param(self, param):
        """The dense form of a (local, detached) param: itself, or its stand-in."""
        if is_dense(param):
            return param
        stand_in = torch.empty_strided(param.shape, dense_strides(param), dtype=param.dtype,
                                       device=param.device)
        self.params.append((param, stand_in))
        return stand_in

    def grad(self, index: int, grad, form):
        """The grad the plan reads for the param of dense form `form` at `index`: the grad
        itself where it is laid out as the form, else a stand-in that each step fills."""
        if same_layout(grad, form):
            return grad
        self.grads[index] = torch.empty_strided(form.shape, form.stride(), dtype=grad.dtype,
                                                device=form.device)
        return self.grads[index]

    @staticmethod
    def state(tensor, form, where: str):
        """A state tensor laid out as the param's dense form: itself, or a copy (made once,
        which the caller keeps as the state). 8-bit codes are blockwise in memory order, so
        they cannot be laid out again: refused."""
        if tuple(tensor.shape) != tuple(form.shape) or same_layout(tensor, form):
            return tensor  # a per-block scale, or laid out as the param
        if tensor.dtype == torch.uint8:
            raise ValueError(f"{where} holds 8-bit codes laid out with strides {tensor.stride()} "
                             f"but its param steps with strides {form.stride()}: make the param "
                             f"the layout it was saved with (e.g. .contiguous() or "
                             f"channels_last), or start this param's state afresh")
        copy = torch.empty_strided(form.shape, form.stride(), dtype=tensor.dtype,
                                   device=tensor.device)
        return copy.copy_(tensor)

    def before(self, grads: list) -> None:
        """Fills the stand-ins from the params and the current grads (the plan's order)."""
        for param, stand_in in self.params:
            stand_in.copy_(param)
        for index, stand_in in self.grads.items():
            stand_in.copy_(grads[index])

    def after(self) -> None:
        """Copies the stepped stand-ins back into their params."""
        for param, stand_in in self.params:
            param.copy_(stand_in)

    def bound_grads(self, grads: list, addresses):
        """The grads a plan reads for `grads` (its order), as real, and their addresses:
        the stand-ins' where grads are staged."""
        if self.grads:
            grads = list(grads)
            addresses = addresses.copy()
            for index, stand_in in self.grads.items():
                grads[index] = stand_in
                addresses[index] = stand_in.data_ptr()
        return as_reals(grads), addresses


class PlanLists:
    """What one plan binds for params of one device: their dense forms (of their local
    shards, by `local`) viewed as real, their grads (or stand-ins) and their states, each
    state laid out as its param's dense form (a state of another layout is replaced in
    `state` once by such a copy). `staging` copies around each step. `masters`: the params'
    fp32 masters as the plan takes them (`state("master_param")`), for params that step
    through them; else None."""

    masters = None

    def __init__(self, state: dict, params: list, grads: list, local=None):
        self.params, self._state = params, state
        self._local = local or (lambda tensor: tensor)
        self.staging = Staging()
        self._forms = [self.staging.param(self._local(p).detach()) for p in params]
        self.bound = as_reals(self._forms)
        self.grads = as_reals([self.staging.grad(i, self._local(g), form)
                               for i, (g, form) in enumerate(zip(grads, self._forms))])

    def state(self, name: str) -> list:
        """Each param's state tensor `name`, as the plan takes it."""
        out = []
        for p, form in zip(self.params, self._forms):
            entry = self._state[p]
            local = shard_scales(entry[name], form) if name.endswith("_absmax") else \
                self._local(entry[name])
            laid_out = Staging.state(local, form, f"state[{name!r}]")
            if laid_out is not local:
                entry[name] = laid_out  # a plain tensor (a DTensor's shard is its param's layout)
            out.append(as_real(laid_out))
        return out
