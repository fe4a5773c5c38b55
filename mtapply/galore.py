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

import numpy as np

from . import _calls
from ._dlpack import framework_of
from ._products import BoundProducts, batchable, data_ptr, operand_addresses
from .plan import Plan
from .ops._spec import check_number
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
        matrix has fewer, as galore-torch takes them), and the buffers it needs."""
        self.ortho = projector(grad, rank, self.left)
        self.make_buffers(grad)

    def make_buffers(self, grad) -> None:
        """R's and N's buffers for the projector (kept while their shape fits it)."""
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


def _projection_term(matrix, projection) -> tuple:
    """R's product for a grad (or its param, which has the grad's layout)."""
    return (("T", "N", projection.ortho, matrix, projection.projected) if projection.left
            else ("N", "T", matrix, projection.ortho, projection.projected))


def _back_term(param, projection) -> tuple:
    """The product P N (or N Q) that writes `param`."""
    return (("N", "N", projection.ortho, projection.normalized, param) if projection.left
            else ("N", "N", projection.normalized, projection.ortho, param))


class _StepProducts:
    """Products of the same terms every step: float32 GPU matrices batched by shape (bound
    once), the others by their framework's matmul one by one (`alone(k)`). `addresses` holds
    the batched terms' operands, one row each; a caller rewrites the cells that move."""

    def __init__(self, terms: list):
        self.batched = [k for k, term in enumerate(terms) if all(map(batchable, term[2:]))]
        self.bound = BoundProducts([terms[k] for k in self.batched]) if self.batched else None
        left = self.bound.left if self.bound else []
        self.alone = sorted(set(range(len(terms))) - set(self.batched)
                            | {self.batched[k] for k in left})
        self.readdress(terms)

    def readdress(self, terms: list) -> None:
        """The operands' addresses of `terms` (the bound terms with new operands)."""
        self.addresses = operand_addresses([terms[k][2:] for k in self.batched])

    def run(self, alone, *, alpha: float, beta: float) -> None:
        if self.bound is not None:
            self.bound.run(self.addresses, alpha=alpha, beta=beta)
        for k in self.alone:
            alone(k)


class ProjectedStep:
    """The step of fixed lists of projected matrices (params, projections, moments), bound
    once: the products that project the grads, a plan of the Adam step over the projections
    (writing N), and the products that write the params back. A step then reads each grad's
    address and layout, and nothing else per matrix.

    The grads must have their params' shapes, dtypes and devices (as torch's `.grad` has):
    a grad that is not row-major makes every product of that step run alone."""

    def __init__(self, params: list, projections: list, exp_avgs: list, exp_avg_sqs: list):
        self.params, self.projections = params, projections
        self.plan = Plan(_NORMALIZED_STEP, {
            "params": [p.normalized for p in projections],
            "grads": [p.projected for p in projections],
            "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs})
        # a grad has its param's layout, so the param stands for it in the terms
        self._forward = _StepProducts(self._forward_terms())
        self._back = _StepProducts(self._back_terms())
        self._orthos = [p.ortho for p in projections]  # the projectors addressed
        batched = self._forward.batched
        self._grad_cells = (np.arange(len(batched)),  # each batched grad's (row, column)
                            np.array([1 if projections[k].left else 0 for k in batched], np.intp))

    def _forward_terms(self) -> list:
        return [_projection_term(param, projection)
                for param, projection in zip(self.params, self.projections)]

    def _back_terms(self) -> list:
        return [_back_term(param, projection)
                for param, projection in zip(self.params, self.projections)]

    def run(self, grads: list, *, lr: float, step: int, betas, eps: float, weight_decay: float,
            scale: float, correct_bias: bool = True) -> None:
        """One step: R of each grad, Adam on R writing N, then W = (1 - lr wd)(W + scale P N)."""
        if any(p.ortho is not ortho for p, ortho in zip(self.projections, self._orthos)):
            self._forward.readdress(self._forward_terms())  # refreshed projectors
            self._back.readdress(self._back_terms())
            self._orthos = [p.ortho for p in self.projections]
        self._project(grads)
        self.plan.step(**adam_arguments(lr, step, betas, eps, 0.0, correct_bias))
        decay = 1.0 - lr * weight_decay
        params, projections = self.params, self.projections
        self._back.run(lambda k: _project_back(params[k], projections[k], decay, decay * scale),
                       alpha=decay * scale, beta=decay)

    def _project(self, grads: list) -> None:
        projections = self.projections
        batched = [grads[k] for k in self._forward.batched]
        if not all(map(_row_major, batched)):
            for grad, projection in zip(grads, projections):
                projection.project(grad)
            return
        if batched:
            self._forward.addresses[self._grad_cells] = np.fromiter(
                map(data_ptr, batched), np.uint64, len(batched))
        self._forward.run(lambda k: projections[k].project(grads[k]), alpha=1.0, beta=0.0)


def _row_major(matrix) -> bool:
    contiguous = getattr(matrix, "is_contiguous", None)  # torch; else CuPy
    return contiguous() if contiguous is not None else matrix.flags.c_contiguous


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


class ProjectedSteps:
    """The optimizer's `ProjectedStep`s, each bound to the params, work buffers and moments it
    steps. They stay put between refreshes, so a step finds its own by their identities alone
    (it holds them, so no identity is reused while it lives)."""

    KEEP = 4  # steps kept (one per set of params stepped together)

    def __init__(self):
        self._steps: dict = {}

    def get(self, params: list, projections: list, exp_avgs: list,
            exp_avg_sqs: list) -> ProjectedStep:
        key = (tuple(map(id, params)) + tuple(map(id, exp_avgs)) + tuple(map(id, exp_avg_sqs))
               + tuple(id(p.projected) for p in projections)
               + tuple(id(p.normalized) for p in projections))
        bound = self._steps.pop(key, None)
        if bound is None:
            bound = ProjectedStep(params, projections, exp_avgs, exp_avg_sqs)
        self._steps[key] = bound  # the latest last
        while len(self._steps) > self.KEEP:
            del self._steps[next(iter(self._steps))]
        return bound


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


def check_options(lr, weight_decay, eps, betas, rank=None, update_proj_gap=1,
                  where: str = "") -> None:
    """Raises ValueError or TypeError naming the option as the caller gave it (after `where`,
    e.g. "param group 1: ") and its value, before anything is written."""
    lr = check_number(f"{where}lr", lr, low=0.0)
    check_number(f"{where}eps", eps, low=0.0)
    weight_decay = check_number(f"{where}weight_decay", weight_decay, low=0.0)
    if not lr * weight_decay < 1.0:
        raise ValueError(f"{where}lr * weight_decay must be < 1 (the params are scaled by "
                         f"1 - lr * weight_decay), got lr={lr!r} and weight_decay={weight_decay!r}")
    if len(betas) != 2:
        raise ValueError(f"{where}betas must be two numbers (beta1, beta2), got {betas!r}")
    for k, beta in enumerate(betas):
        check_number(f"{where}betas[{k}]", beta, low=0.0, high=1.0, high_open=True)
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ValueError(f"{where}rank must be a positive integer, got {rank!r}")
    if isinstance(update_proj_gap, bool) or not isinstance(update_proj_gap, int) or (
            update_proj_gap < 1):
        raise ValueError(f"{where}update_proj_gap must be an integer >= 1, got {update_proj_gap!r}")


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
    steps: ProjectedSteps = field(default_factory=ProjectedSteps, repr=False)

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
    for i, (param, grad) in enumerate(zip(params, grads)):
        if _layout(grad) != _layout(param):
            raise ValueError(f"grads[{i}] is {_describe(grad)} but params[{i}] is "
                             f"{_describe(param)}: pass each param's grad, of its shape, dtype "
                             f"and device")
    refresh = (step - 1) % state.update_proj_gap == 0
    projected, plain = [], []
    for i, (grad, projection) in enumerate(zip(grads, state.projections)):
        if projection is None:
            plain.append(i)
            continue
        if refresh or projection.ortho is None:
            projection.refresh(grad, state.rank)
        projected.append(i)
    options = dict(lr=lr, step=step, betas=betas, eps=eps, weight_decay=weight_decay,
                   correct_bias=correct_bias)
    if projected:
        bound = state.steps.get([params[i] for i in projected],
                                [state.projections[i] for i in projected],
                                [state.exp_avgs[i] for i in projected],
                                [state.exp_avg_sqs[i] for i in projected])
        bound.run([grads[i] for i in projected], scale=state.scale, **options)
    if plain:
        step_plain([params[i] for i in plain], [grads[i] for i in plain],
                   [state.exp_avgs[i] for i in plain], [state.exp_avg_sqs[i] for i in plain],
                   **options)


def _layout(array) -> tuple:
    device = getattr(array, "device", "cpu")
    return (framework_of(array), tuple(array.shape), str(array.dtype),
            str(getattr(device, "id", device)))


def _describe(array) -> str:
    framework, shape, dtype, device = _layout(array)
    return f"{dtype} {shape} on {device} ({framework})"


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
