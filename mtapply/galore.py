"""GaLore AdamW (Zhao et al. 2024, "GaLore: Memory-Efficient LLM Training by Gradient Low-Rank
Projection") on raw lists of torch tensors, CuPy or NumPy arrays: `galore_state` and
`galore_adamw_step`; `mtapply.torch.GaLoreAdamW` builds on the same steps.

Each projected matrix keeps Adam moments of rank r: its grad G (m x n) is projected, R = P^T G
(P: m x r, "left") or R = G Q^T (Q: r x n, "right"), the projector being the grad's first
singular vectors, refreshed every `update_proj_gap` steps. Per step: a GEMM per matrix projects
its grad into a kept buffer; one mtapply launch runs the Adam steps of all projected grads and
writes their normalized steps N (Adam's zero-param mode); a GEMM per matrix writes the param,
W = (1 - lr wd) W + (1 - lr wd) scale P N, its beta carrying the weight decay. Other params take
one launch of plain AdamW of the same form. The update is galore-torch's AdamW
(`mtapply.reference.galore_adamw`): eps added to the root of the uncorrected second moment,
weight decay applied to the updated param.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import _calls
from ._dlpack import framework_of
from ._products import Products, batchable
from .engine import Plan
from .ops.adam import AdamSpec

PROJECTION_TYPES = ("std", "reverse_std", "left", "right")
_NO_BIAS_CORRECTION = 1e9  # a step count whose bias corrections are 1 in double precision
_ADAMW = AdamSpec(decoupled_weight_decay=True)
_NORMALIZED_STEP = _ADAMW.with_param_mode("zero")  # writes the normalized step into `params`


def projection_side(shape, proj_type: str) -> str:
    """"left" (R = P^T G) or "right" (R = G Q^T) for a matrix of `shape`, as galore-torch
    chooses: "std" projects the longer side away, "reverse_std" the shorter."""
    if proj_type not in PROJECTION_TYPES:
        raise ValueError(f"proj_type {proj_type!r}: use one of {', '.join(PROJECTION_TYPES)}")
    rows, cols = shape
    if proj_type == "std":
        return "right" if rows >= cols else "left"
    if proj_type == "reverse_std":
        return "left" if rows >= cols else "right"
    return proj_type


@dataclass
class Projection:
    """One matrix's projector (None until the first step) and its two work buffers."""

    left: bool
    ortho: object = None
    projected: object = None  # R
    normalized: object = None  # N

    def refresh(self, grad, rank: int) -> None:
        """A projector from the grad's first `rank` singular vectors (all of them where the
        matrix has fewer, as galore-torch takes them)."""
        self.ortho = projector(grad, rank, self.left)

    def make_buffers(self, grad) -> None:
        """R's and N's buffers (made at the first step, kept after)."""
        rows, cols = grad.shape
        k = self.ortho.shape[1] if self.left else self.ortho.shape[0]
        shape = (k, cols) if self.left else (rows, k)
        if self.projected is None or tuple(self.projected.shape) != shape:
            self.projected = _linear(grad).empty(shape, grad)
            self.normalized = _linear(grad).empty(shape, grad)

    def project(self, grad) -> None:
        """R of the grad into its buffer."""
        self.make_buffers(grad)
        _linear(grad).project(self.ortho, grad, self.projected, self.left)


def project_all(grads: list, projections: list, products: Products | None = None) -> None:
    """R of each grad into its buffer: float32 matrices on a GPU by one batched product per
    shape (given `products`), the others by one matmul each."""
    def term(grad, projection):
        projection.make_buffers(grad)
        return (("T", "N", projection.ortho, grad, projection.projected) if projection.left
                else ("N", "T", grad, projection.ortho, projection.projected))

    _batched(zip(grads, projections), term, lambda grad, projection: projection.project(grad),
             products, alpha=1.0, beta=0.0)


def project_back_all(params: list, projections: list, beta: float, alpha: float,
                     products: Products | None = None) -> None:
    """param = beta param + alpha (P N or N Q) for each param, batched as `project_all`."""
    def term(param, projection):
        return (("N", "N", projection.ortho, projection.normalized, param) if projection.left
                else ("N", "N", projection.normalized, projection.ortho, param))

    _batched(zip(params, projections), term,
             lambda param, projection: _project_back(param, projection, beta, alpha),
             products, alpha=alpha, beta=beta)


def _batched(pairs, term, alone, products: Products | None, alpha: float, beta: float) -> None:
    """For each (matrix, projection): its product `term(...)` batched with the others of its
    shape where both operands batch (given `products`), else `alone(...)`; products that the
    batch leaves out run alone too."""
    terms, of_term = [], {}
    for matrix, projection in pairs:
        if products is not None and batchable(matrix) and batchable(projection.ortho):
            terms.append(term(matrix, projection))
            of_term[id(terms[-1])] = (matrix, projection)
        else:
            alone(matrix, projection)
    for left_out in products.run(terms, alpha=alpha, beta=beta) if terms else ():
        alone(*of_term[id(left_out)])


def _project_back(param, projection, beta: float, alpha: float) -> None:
    _linear(param).project_back(param, projection.ortho, projection.normalized, projection.left,
                                beta, alpha)


def projector(grad, rank: int, left: bool):
    """The grad's first `rank` left (m x r) or right (r x n) singular vectors, from an SVD in
    float32, in the grad's dtype."""
    return _linear(grad).projector(grad, rank, left)


def moment_shape(shape, rank: int, left: bool) -> tuple:
    """The shape of a projected matrix's moments."""
    rows, cols = shape
    return (min(rank, rows, cols), cols) if left else (rows, min(rank, rows, cols))


class BufferPlans:
    """Plans of the projected Adam step, each bound to the buffers and moments it steps. They
    belong to the optimizer and stay put between refreshes, so a step finds its plan by their
    identities alone (the plan holds them, so no identity is reused while it lives). Beside
    them, the batched products of the projections (`products`)."""

    KEEP = 4  # plans kept (one per set of params stepped together)

    def __init__(self):
        self._plans: dict = {}
        self.products = Products()

    def step(self, tensors: dict, arguments: dict) -> None:
        key = tuple(id(t) for column in tensors.values() for t in column)
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = Plan(_NORMALIZED_STEP, tensors)
        self._plans[key] = plan  # the latest last
        while len(self._plans) > self.KEEP:
            del self._plans[next(iter(self._plans))]
        plan.step(**arguments)


def step_projected(params: list, projections: list, exp_avgs: list, exp_avg_sqs: list, *,
                   lr: float, step: int, betas, eps: float, weight_decay: float, scale: float,
                   correct_bias: bool = True, plans: BufferPlans | None = None) -> None:
    """The Adam steps of projected grads (already in their buffers) and the params written
    back: one mtapply launch (by a plan of `plans`, else a one-call step), then one GEMM per
    matrix."""
    tensors = {"params": [p.normalized for p in projections],
               "grads": [p.projected for p in projections],
               "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs}
    arguments = adam_arguments(lr, step, betas, eps, 0.0, correct_bias)
    if plans is None:
        _calls.step(_NORMALIZED_STEP, tensors, **arguments)
    else:
        plans.step(tensors, arguments)
    decay = 1.0 - lr * weight_decay
    project_back_all(params, projections, decay, decay * scale,
                     None if plans is None else plans.products)


def step_plain(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, *, lr: float,
               step: int, betas, eps: float, weight_decay: float, correct_bias: bool = True) -> None:
    """galore-torch's plain AdamW, (p - u) * (1 - lr wd) = p (1 - lr wd) - u (1 - lr wd): mtapply's
    AdamW with the step scaled by 1 - lr wd and the decay rate divided by it."""
    decay = 1.0 - lr * weight_decay
    _calls.step(_ADAMW, {"params": params, "grads": grads, "exp_avgs": exp_avgs,
                         "exp_avg_sqs": exp_avg_sqs},
                **adam_arguments(lr * decay, step, betas, eps, weight_decay / decay, correct_bias))


def adam_arguments(lr, step: int, betas, eps, weight_decay, correct_bias: bool) -> dict:
    """mtapply Adam's arguments for galore-torch's form: its eps is added to sqrt(v) before
    the bias correction, which is mtapply's eps divided by sqrt(1 - beta2**t)."""
    beta1, beta2 = betas
    if not correct_bias:
        return dict(lr=lr, step=_NO_BIAS_CORRECTION, beta1=beta1, beta2=beta2, eps=eps,
                    weight_decay=weight_decay)
    return dict(lr=lr, step=float(step), beta1=beta1, beta2=beta2,
                eps=eps / math.sqrt(1.0 - beta2 ** step), weight_decay=weight_decay)


def check_options(lr, weight_decay, eps, betas, rank=None, update_proj_gap=1) -> None:
    if lr < 0.0 or eps < 0.0 or weight_decay < 0.0 or lr * weight_decay >= 1.0:
        raise ValueError(f"Invalid lr={lr}, eps={eps} or weight_decay={weight_decay} "
                         f"(each >= 0, lr * weight_decay < 1)")
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"Invalid betas: {betas}")
    if rank is not None and (not isinstance(rank, int) or rank < 1):
        raise ValueError(f"rank must be a positive integer, got {rank!r}")
    if update_proj_gap < 1:
        raise ValueError(f"update_proj_gap must be >= 1, got {update_proj_gap}")


# the functional form


@dataclass
class GaLoreState:
    """The state of `galore_adamw_step` over a list of params: per param its moments (of the
    projected shape for a projected matrix) and its Projection (None for a plain param)."""

    rank: int
    update_proj_gap: int
    scale: float
    exp_avgs: list = field(default_factory=list)
    exp_avg_sqs: list = field(default_factory=list)
    projections: list = field(default_factory=list)
    plans: BufferPlans = field(default_factory=BufferPlans, repr=False)

    def nbytes(self) -> int:
        """Bytes of the moments and projectors (not of the work buffers)."""
        arrays = self.exp_avgs + self.exp_avg_sqs + [p.ortho for p in self.projections
                                                     if p is not None and p.ortho is not None]
        return sum(_numel(a) * _itemsize(a) for a in arrays)


def galore_state(params, *, rank: int, update_proj_gap: int = 200, scale: float = 1.0,
                 proj_type: str = "std", project=None) -> GaLoreState:
    """Zero moments for `params`: each 2-D param (or each for which project(i, param) is true)
    is projected to `rank`; the projectors come from the first step's grads."""
    check_options(0.0, 0.0, 0.0, (0.0, 0.0), rank, update_proj_gap)
    state = GaLoreState(rank, update_proj_gap, scale)
    for i, param in enumerate(params):
        linear = _linear(param)
        projected = len(param.shape) == 2 if project is None else bool(project(i, param))
        left = projected and projection_side(tuple(param.shape), proj_type) == "left"
        shape = moment_shape(tuple(param.shape), rank, left) if projected else tuple(param.shape)
        state.exp_avgs.append(linear.zeros(shape, param))
        state.exp_avg_sqs.append(linear.zeros(shape, param))
        state.projections.append(Projection(left) if projected else None)
    return state


def galore_adamw_step(params, grads, state: GaLoreState, *, lr, step: int, betas=(0.9, 0.999),
                      eps=1e-6, weight_decay=0.0, correct_bias=True) -> None:
    """One GaLore AdamW step of every param (`step` counts from 1; the projectors are
    refreshed at steps 1, 1 + update_proj_gap, ...), in place."""
    check_options(lr, weight_decay, eps, betas)
    if len(grads) != len(params) or len(state.projections) != len(params):
        raise ValueError(f"params has {len(params)} tensors, grads {len(grads)} and the state "
                         f"{len(state.projections)}: pass one grad and one state entry per param")
    refresh = (step - 1) % state.update_proj_gap == 0
    projected, plain = [], []
    for i, (param, grad, projection) in enumerate(zip(params, grads, state.projections)):
        if projection is None:
            plain.append(i)
            continue
        if refresh or projection.ortho is None:
            projection.refresh(grad, state.rank)
        projected.append(i)
    options = dict(lr=lr, step=step, betas=betas, eps=eps, weight_decay=weight_decay,
                   correct_bias=correct_bias)
    if projected:
        project_all([grads[i] for i in projected], [state.projections[i] for i in projected],
                    state.plans.products)
        step_projected([params[i] for i in projected], [state.projections[i] for i in projected],
                       [state.exp_avgs[i] for i in projected],
                       [state.exp_avg_sqs[i] for i in projected], scale=state.scale,
                       plans=state.plans, **options)
    if plain:
        step_plain([params[i] for i in plain], [grads[i] for i in plain],
                   [state.exp_avgs[i] for i in plain], [state.exp_avg_sqs[i] for i in plain],
                   **options)


# the linear algebra of each framework


def _linear(array):
    framework = framework_of(array)
    if framework not in _LINEAR:
        raise TypeError(f"GaLore takes torch tensors, CuPy or NumPy arrays, got "
                        f"{type(array).__name__}")
    return _LINEAR[framework]


class _Torch:
    @staticmethod
    def projector(grad, rank, left):
        import torch

        u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
        return (u[:, :rank] if left else vh[:rank, :]).to(grad.dtype).contiguous()

    @staticmethod
    def project(ortho, grad, out, left):
        import torch

        torch.matmul(ortho.t(), grad, out=out) if left else torch.matmul(grad, ortho.t(), out=out)

    @staticmethod
    def project_back(param, ortho, normalized, left, beta, alpha):
        a, b = (ortho, normalized) if left else (normalized, ortho)
        param.data.addmm_(a, b, beta=beta, alpha=alpha)

    @staticmethod
    def empty(shape, like):
        import torch

        return torch.empty(shape, dtype=like.dtype, device=like.device)

    @staticmethod
    def zeros(shape, like):
        import torch

        return torch.zeros(shape, dtype=like.dtype, device=like.device)


def _svd_projector(xp, grad, rank: int, left: bool):
    """`projector` in NumPy or CuPy (`xp`)."""
    u, _, vh = xp.linalg.svd(grad.astype(xp.float32), full_matrices=False)
    return xp.ascontiguousarray((u[:, :rank] if left else vh[:rank, :]).astype(grad.dtype))


class _CuPy:
    @staticmethod
    def projector(grad, rank, left):
        import cupy

        return _svd_projector(cupy, grad, rank, left)

    @staticmethod
    def project(ortho, grad, out, left):
        from cupy import cublas

        if left:
            cublas.gemm("T", "N", ortho, grad, out=out)
        else:
            cublas.gemm("N", "T", grad, ortho, out=out)

    @staticmethod
    def project_back(param, ortho, normalized, left, beta, alpha):
        from cupy import cublas

        a, b = (ortho, normalized) if left else (normalized, ortho)
        cublas.gemm("N", "N", a, b, out=param, alpha=alpha, beta=beta)

    @staticmethod
    def empty(shape, like):
        import cupy

        with like.device:
            return cupy.empty(shape, like.dtype)

    @staticmethod
    def zeros(shape, like):
        import cupy

        with like.device:
            return cupy.zeros(shape, like.dtype)


class _NumPy:
    @staticmethod
    def projector(grad, rank, left):
        import numpy as np

        return _svd_projector(np, grad, rank, left)

    @staticmethod
    def project(ortho, grad, out, left):
        import numpy as np

        np.matmul(ortho.T, grad, out=out) if left else np.matmul(grad, ortho.T, out=out)

    @staticmethod
    def project_back(param, ortho, normalized, left, beta, alpha):
        product = ortho @ normalized if left else normalized @ ortho
        param *= param.dtype.type(beta)
        param += param.dtype.type(alpha) * product

    @staticmethod
    def empty(shape, like):
        import numpy as np

        return np.empty(shape, like.dtype)

    @staticmethod
    def zeros(shape, like):
        import numpy as np

        return np.zeros(shape, like.dtype)


_LINEAR = {"torch": _Torch, "cupy": _CuPy, "numpy": _NumPy}


def _numel(array) -> int:
    return int(math.prod(array.shape))


def _itemsize(array) -> int:
    size = getattr(array, "itemsize", None)
    return int(size) if size is not None else array.element_size()


__all__ = [
    "PROJECTION_TYPES",
    "GaLoreState",
    "Projection",
    "galore_adamw_step",
    "galore_state",
    "projection_side",
    "projector",
]
