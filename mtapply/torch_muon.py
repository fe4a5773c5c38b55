"""`mtapply.torch.Muon`: torch.optim.Muon (momentum, Newton-Schulz orthogonalization of each
2-D update, decoupled weight decay) over all of a param group's matrices at once.

A step is four passes, whatever the number of matrices: one launch of the rule
`library.muon_momentum` updates every momentum buffer and writes each matrix's update in
bfloat16 straight into a batch of its shape (a (count, rows, cols) buffer kept between steps,
one per shape); one launch of `library.muon_normalize` divides every matrix of every batch by
its norm into the batch's second buffer; Newton-Schulz then runs on each batch with batched
products (torch.bmm and torch.baddbmm, in bfloat16 with float32 accumulation, as
torch.optim.Muon's per-matrix torch.addmm), the Gram matrix taken on the short side (a tall
matrix's X^T X, so the result keeps the param's own layout). The Gram matrices of every batch
of one short side lie in one buffer, so that each iteration's b G + c G G is one product over
all of them (faster than one per shape: gpt2-hidden's four shapes of side 768 take 80 us
joined against 4 x 25 us on an H200). On CUDA b G + c G G and the X update a X + B X are cuBLASLt
products (`_lt_products`) whose output is not their C: baddbmm's sums without its copy of C
into the output first (a third of their time). One launch of `library.muon_apply` then applies
weight decay and the update scaled by each matrix's adjusted lr. Nothing waits for the GPU,
and after the first step nothing is allocated.

FSDP2 (DTensor) matrices: the momentum pass writes each shard's update into a buffer of the
shard's shape, an all-gather makes the whole matrix on every rank (in torch's cached
blocks), every rank runs Newton-Schulz on the whole matrices, and the last pass steps each
rank's shard with its part of the result.

Groups with `use_muon=False` step with AdamW instead (the usual hybrid: embeddings, heads,
norms and biases), one mtapply launch per group, with torch.optim.AdamW's state."""
from __future__ import annotations

import math

import torch

from ._dtensor import is_dtensor, local_tensors
from ._launch import stream_pointer
from ._muon_state import Storage
from ._optimizer_step import closure_loss
from .ops._spec import check_number
from .rules import library

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
AUX_BETAS = (0.9, 0.95)  # a use_muon=False group's AdamW betas where it gives none
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


class Muon(torch.optim.Optimizer):
    """`torch.optim.Muon` with its arguments, defaults, checks and state (`momentum_buffer`
    per param), so that checkpoints move both ways; for 2-D params only (the hidden matrices:
    give embeddings, heads, norms and biases to an AdamW). `lr` may be a one-element tensor:
    a CUDA one is read by the kernels where it lies, a CPU one on the host.

    A group with `use_muon=False` steps with AdamW, for params of any shape: its `lr`,
    `betas` ((0.9, 0.95) where the group gives none), `eps` (the group's, as an AdamW's: Muon's
    default 1e-7 where it gives none) and `weight_decay`, and torch.optim.AdamW's state
    (`step`, `exp_avg`, `exp_avg_sq`): one optimizer and one `step()` for a whole model.
    Such a group refuses AdamW's `maximize=True` and `amsgrad=True`.

    `state_bits=16` keeps that state in bfloat16, `state_bits=8` as 8-bit codes with a float32
    scale per 256 elements (`<name>_absmax`; params of fewer than `min_8bit_size` elements keep
    float32 state), as the other mtapply.torch optimizers do (see mtapply._muon_state).

    Every group is checked before a step writes anything. Matrices of one shape (transposes
    apart) step as one batch: see the module docstring."""

    def __init__(self, params, lr=1e-3, weight_decay=0.1, momentum=0.95, nesterov=True,
                 ns_coefficients=NS_COEFFICIENTS, eps=1e-7, ns_steps=5, adjust_lr_fn=None, *,
                 state_bits=32, min_8bit_size=4096):
        self._storage = Storage(state_bits, min_8bit_size)
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=ns_coefficients, eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn)
        _check_group("", defaults)
        self._batches: dict = {}  # (group index, device, dtype, shape) -> _Batch
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict) -> None:
        if param_group.get("use_muon", True) is False:
            param_group.setdefault("betas", AUX_BETAS)
        super().add_param_group(param_group)
        index = len(self.param_groups) - 1
        try:
            _check_group(f"param group {index}: ", self.param_groups[-1])
            _check_matrices(index, self.param_groups[-1])
        except BaseException:
            self.param_groups.pop()  # a refused group is not kept
            raise

    @property
    def state_bits(self) -> int:
        return self._storage.bits

    @property
    def min_8bit_size(self) -> int:
        return self._storage.min_8bit_size

    def __getstate__(self):  # a copy keeps its state's storage
        return dict(super().__getstate__(), state_bits=self.state_bits,
                    min_8bit_size=self.min_8bit_size)

    def __setstate__(self, state) -> None:
        # from a copy (its storage given), or from torch's load_state_dict (the storage kept)
        state = dict(state)
        storage = self.__dict__.get("_storage") or Storage()
        if "state_bits" in state:
            storage = Storage(state.pop("state_bits"), state.pop("min_8bit_size", 4096))
        super().__setstate__(state)
        self._storage = storage
        self._batches = {}

    def load_state_dict(self, state_dict) -> None:
        """torch.optim's load, each state tensor then kept as this optimizer's `state_bits`
        store it (bfloat16, or 8-bit codes and float32 scales, which torch would cast to the
        param's dtype). State saved at other state_bits is refused before anything changes."""
        groups = self.param_groups
        saved_groups = state_dict["param_groups"]
        pairs = []  # (param, saved entry)
        if len(groups) == len(saved_groups) and all(
                len(g["params"]) == len(h["params"]) for g, h in zip(groups, saved_groups)):
            for index, (group, saved) in enumerate(zip(groups, saved_groups)):
                for i, (p, key) in enumerate(zip(group["params"], saved["params"])):
                    entry = state_dict["state"].get(key)
                    if entry is not None:
                        where = lambda index=index, i=i: f"param group {index}: param {i}"
                        self._storage.check_saved(p, entry, saved.get("use_muon", True), where)
                        pairs.append((p, entry))
        super().load_state_dict(state_dict)  # (checks the groups' sizes itself)
        for p, entry in pairs:
            for key, value in entry.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    self.state[p][key] = self._storage.loaded(p, value)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        steps = [self._prepared(index, group) for index, group in enumerate(self.param_groups)]
        for group, params in steps:  # every group checked: now the writes
            if params and group.get("use_muon", True):
                self._step_group(group, params)
            elif params:
                self._adamw_step(group, params)
        return loss

    def _prepared(self, index: int, group) -> tuple:
        """The group and its params with grads, after every check a step makes."""
        _check_group(f"param group {index}: ", group)
        _check_matrices(index, group)
        params = [p for p in group["params"] if p.grad is not None]
        muon = group.get("use_muon", True)
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            if p.is_complex():  # as torch.optim.Muon: at the step
                raise RuntimeError("Muon does not support complex parameters")
            where = f"param group {index}: param {i}"
            laid_out = p.is_contiguous() or _transposed(p)  # row-major, or its transpose
            if muon and not laid_out:
                raise ValueError(f"{where} has strides {p.stride()}: Muon steps row-major "
                                 f"matrices and their transposes (its update batches are "
                                 f"row-major); make it contiguous")
            _check_like(p, p.grad, f"{where}'s grad", strides=not laid_out)
            if p in self.state:
                self._storage.check(p, self.state[p], muon, lambda where=where: where)
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and any(
                p.device != lr.device for p in params):
            raise ValueError(f"param group {index}: lr is a tensor on {lr.device} but the "
                             f"params are on {params[0].device}: keep it with them, or on the CPU")
        return group, params

    def _adamw_step(self, group, params: list) -> None:
        """A `use_muon=False` group: one AdamW launch, with torch.optim.AdamW's state (its step
        count a CPU tensor per param, so that reading it waits for nothing)."""
        steps = []
        for p in params:
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
            self._storage.make(p, state, muon=False)
            state["step"] += 1
            steps.append(float(state["step"]))
        beta1, beta2 = group["betas"]
        rule = self._storage.adamw_rule()
        rule.step(*self._storage.arguments(rule, params, self.state,
                                           {"param": params, "grad": _grads(params)}),
                  lr=_lr_value(group["lr"]), step=steps[0] if len(set(steps)) == 1 else steps,
                  beta1=float(beta1), beta2=float(beta2), eps=float(group["eps"]),
                  weight_decay=float(group["weight_decay"]))

    def _step_group(self, group, params: list) -> None:
        for p in params:
            self._storage.make(p, self.state[p], muon=True)
        batches = self._batches_of(group, params)
        given = {"param": params, "grad": _grads(params),
                 "direction": [batch.direction(k) for batch, k in batches]}
        rule = self._storage.momentum_rule(group["nesterov"])
        rule.step(*self._storage.arguments(rule, params, self.state, given),
                  momentum=float(group["momentum"]))
        distinct = list({id(batch): batch for batch, _ in batches}.values())
        for batch in distinct:
            batch.gather()
        library.muon_normalize().step([x for batch in distinct for x in batch.starts],
                                      [x for batch in distinct for x in batch.views],
                                      eps=float(group["eps"]))
        done = newton_schulz(distinct, group["ns_coefficients"], int(group["ns_steps"]))
        updates = [batch.update(done[id(batch)], k) for batch, k in batches]
        scales = [_lr_ratio(group["adjust_lr_fn"], p.shape) for p in params]
        library.muon_apply().step(local_tensors(params), updates, lr=_lr_value(group["lr"]),
                                  weight_decay=float(group["weight_decay"]), scale=scales)

    def _batches_of(self, group, params: list) -> list:
        """(batch, index in it) of each param: params of one device, dtype and shape share a
        batch, kept while the group's params of that shape stay the same. A transposed matrix
        (column-major) steps as its row-major transpose, in the batch of that shape: the
        Newton-Schulz of a transpose is the transpose of the Newton-Schulz."""
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        members: dict = {}
        for p in params:
            members.setdefault((p.device, p.dtype, _row_major_shape(p)), []).append(p)
        where = {}
        for key, same in members.items():
            batch = self._batches.get((index, *key))
            if batch is None or batch.ids != tuple(map(id, same)):
                batch = self._batches[(index, *key)] = _Batch(same)
            where.update((id(p), (batch, k)) for k, p in enumerate(same))
        return [where[id(p)] for p in params]


class _Batch:
    """The bfloat16 work buffers of `count` matrices of one shape: the updates (written by the
    momentum pass, each param's slice a view), a second buffer of that shape for Newton-Schulz
    to alternate with, and the (count, r, r) Gram matrices of the short side r, slices of a
    `_Grams` that the batch may share with the group's other batches of that side.

    A DTensor param (an FSDP2 shard) has its update written into a buffer of its local shard,
    which `gather` all-gathers into its whole matrix in the batch: every rank orthogonalizes
    the whole matrices and steps its own shard with its part of the result (`update`)."""

    def __init__(self, params: list):
        self.ids = tuple(map(id, params))
        self.shards = {k: _Shard(p) for k, p in enumerate(params) if is_dtensor(p)}
        rows, cols = _row_major_shape(params[0])
        self.transposed = {k for k, p in enumerate(params) if _transposed(p)}
        like = dict(device=params[0].device, dtype=torch.bfloat16)
        # zeros, not empty: the CPU backend reads the momentum rule's `direction` slot before
        # writing it, and uninitialised bfloat16 bits would warn there as NaNs (made once)
        self.updates = torch.zeros((len(params), rows, cols), **like)
        self.other = torch.empty_like(self.updates)
        self.side = min(rows, cols)
        # G and G', slices of the `_Grams` of the batch's side (`_Grams.join`, at its first step)
        self.grams = self.gram = self.gram_update = None
        self.wide = rows <= cols
        self.lt = None  # the X update by cuBLASLt (CUDA), made at the first step
        self.views = list(self.updates.unbind(0))
        self.starts = list(self.other.unbind(0))  # each update divided by its norm goes here
        self.results = {id(self.updates): self.views, id(self.other): self.starts}

    @property
    def count(self) -> int:
        return self.updates.shape[0]

    def share(self, grams: "_Grams", start: int) -> None:
        """Keep the Gram matrices G and G' in `grams`, from matrix `start` on."""
        self.grams = grams
        self.gram = grams.gram[start:start + self.count]
        self.gram_update = grams.gram_update[start:start + self.count]

    def direction(self, k: int):
        """Where the momentum pass writes matrix k's update: its shard's buffer, or the batch."""
        shard = self.shards.get(k)
        if shard is not None:
            return shard.direction
        return self.views[k].t() if k in self.transposed else self.views[k]

    def gather(self) -> None:
        """Each sharded matrix's update, whole, into the batch."""
        for k, shard in self.shards.items():
            self.views[k].copy_(shard.whole())

    def update(self, results: list, k: int):
        """Matrix k's orthogonalized update, or a sharded param's part of it."""
        shard = self.shards.get(k)
        if shard is not None:
            return results[k][shard.part].contiguous()
        return results[k].t() if k in self.transposed else results[k]

    def _lt_update(self):
        """On CUDA, the X update by cuBLASLt, whose C is not its output (no copy of C into the
        output first, as baddbmm makes); False elsewhere or where cuBLASLt is missing."""
        if self.lt is None:
            count, rows, cols = self.updates.shape
            self.lt = (_lt_products(self.updates, count, rows, self.side, cols) if self.wide
                       else _lt_products(self.updates, count, rows, self.side, self.side))
        return self.lt

    # One Newton-Schulz iteration is these three products (mtapply.bench.products times each).
    # A wide batch iterates on X X^T: X <- a X + (b G + c G G) X; a tall one on the transpose,
    # kept in the param's layout: G = X^T X, X <- a X + X G'.

    def gram_of(self, x) -> None:
        """G = X X^T (wide) or X^T X (tall), into `gram`."""
        if self.wide:
            torch.bmm(x, x.mT, out=self.gram)
        else:
            torch.bmm(x.mT, x, out=self.gram)

    def gram_polynomial(self, b: float, c: float) -> None:
        """G' = b G + c G G, into `gram_update`, for this batch and every batch it shares its
        Gram matrices with: one product."""
        self.grams.polynomial(b, c)

    def x_update(self, x, y, a: float) -> None:
        """y = a X + G' X (wide) or a X + X G' (tall): one cuBLASLt product on CUDA."""
        lt = self._lt_update()
        if lt:
            if self.wide:
                lt(self.gram_update, x, x, y, 1.0, a, _stream(x))
            else:
                lt(x, self.gram_update, x, y, 1.0, a, _stream(x))
        elif self.wide:
            torch.baddbmm(x, self.gram_update, x, beta=a, out=y)
        else:
            torch.baddbmm(x, x, self.gram_update, beta=a, out=y)


class _Grams:
    """Newton-Schulz's Gram matrices G and G' = b G + c G G of one short side, (count, side,
    side) bfloat16 each: one batch's, or those of every batch of a group's side on a device
    (`join`), each batch's a slice, so that one product makes G' for them all (cuBLASLt's
    m x m products run nearer the GPU's throughput in one large batch than in several)."""

    def __init__(self, count: int, side: int, device):
        self.gram = torch.empty((count, side, side), device=device, dtype=torch.bfloat16)
        self.gram_update = torch.empty_like(self.gram)
        self.batches = ()  # the batches sharing these, in order
        self.lt = None  # the product by cuBLASLt (CUDA), made at the first step

    @classmethod
    def join(cls, batches: list) -> "_Grams":
        """The Gram matrices of `batches` (one side, one device) in one `_Grams`, made again
        only when the batches change (a batch left out of a step, then back, may still hold
        the older one: every batch must hold it)."""
        grams = batches[0].grams
        if (grams is not None and grams.batches == tuple(batches)
                and all(batch.grams is grams for batch in batches)):
            return grams
        grams = cls(sum(batch.count for batch in batches), batches[0].side,
                    batches[0].updates.device)
        grams.batches = tuple(batches)
        start = 0
        for batch in batches:
            batch.share(grams, start)
            start += batch.count
        return grams

    def polynomial(self, b: float, c: float) -> None:
        """G' = b G + c G G, into `gram_update`: one cuBLASLt product on CUDA."""
        if self.lt is None:
            count, side, _ = self.gram.shape
            self.lt = _lt_products(self.gram, count, side, side, side)
        g = self.gram
        if self.lt:
            self.lt(g, g, g, self.gram_update, c, b, _stream(g))
        else:
            torch.baddbmm(g, g, g, beta=b, alpha=c, out=self.gram_update)


def newton_schulz(batches: list, coefficients, steps: int) -> dict:
    """Newton-Schulz on every update of every batch, each divided by its norm into `starts`
    (`library.muon_normalize`): id(batch) -> each matrix's result (a view). Each iteration
    takes every batch's Gram matrices, then G' once for each short side, then every X update."""
    a, b, c = coefficients
    sides: dict = {}
    for batch in batches:
        sides.setdefault((batch.updates.device, batch.side), []).append(batch)
    grams = [_Grams.join(same) for same in sides.values()]
    pairs = [(batch.other, batch.updates) for batch in batches]
    for _ in range(steps):
        for batch, (x, _) in zip(batches, pairs):
            batch.gram_of(x)
        for joined in grams:
            joined.polynomial(b, c)
        for batch, (x, y) in zip(batches, pairs):
            batch.x_update(x, y, a)
        pairs = [(y, x) for x, y in pairs]
    return {id(batch): batch.results[id(x)] for batch, (x, _) in zip(batches, pairs)}


def _lt_products(like, count: int, m: int, k: int, n: int):
    """On `like`'s CUDA device, cuBLASLt's product of `count` (m, k) by (k, n) matrices whose
    C is not its output; False elsewhere or where cuBLASLt is missing."""
    if not like.is_cuda:
        return False
    from ._lt_products import LtProducts

    try:
        return LtProducts(count, m, k, n, like.device)
    except (OSError, RuntimeError):
        return False


def _stream(tensor) -> int:
    """torch's current stream on the tensor's device (cuBLASLt takes it per product)."""
    return stream_pointer(None, "torch", tensor.device.index)


class _Shard:
    """A DTensor matrix's local shard: a bfloat16 buffer of its shape for the momentum pass's
    update, and where the shard lies in the whole matrix."""

    def __init__(self, param):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.mesh, self.placements = param.device_mesh, param.placements
        self.shape, self.stride = param.shape, param.stride()
        local = param.to_local()
        self.direction = torch.zeros(local.shape, dtype=torch.bfloat16, device=local.device)
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                              param.placements)
        self.part = tuple(slice(o, o + n) for o, n in zip(offset, shape))

    def whole(self) -> torch.Tensor:
        """The whole matrix of the ranks' shards of the update (an all-gather)."""
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(self.direction, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride).full_tensor()


def _check_like(param, tensor, what: str, strides: bool = True) -> None:
    """That `tensor` (a grad, a state) lies as its param does: what the kernels pair element
    by element (checked before any group steps, so that a refusal writes nothing). The grad of
    a row-major or transposed param may have other strides (`strides=False`): it steps through
    a copy laid out as the param (`_grads`)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} is a {type(tensor).__name__}, not a tensor")
    if (tensor.shape, tensor.dtype, tensor.device) != (param.shape, param.dtype, param.device) \
            or (strides and tensor.stride() != param.stride()):
        raise ValueError(f"{what} is {tuple(tensor.shape)} {tensor.dtype} on {tensor.device} "
                         f"with strides {tensor.stride()}, but the param is "
                         f"{tuple(param.shape)} {param.dtype} on {param.device} with strides "
                         f"{param.stride()}: give it the param's shape, dtype, device and layout")


def _transposed(p) -> bool:
    """Whether matrix `p` is laid out as a row-major matrix's transpose (column-major), and
    not also row-major (a row or a column, whose strides may read either way)."""
    return p.ndim == 2 and not is_dtensor(p) and not p.is_contiguous() and p.t().is_contiguous()


def _row_major_shape(p) -> tuple:
    """The shape of the row-major matrix in `p`'s memory: its own, or its transpose's."""
    return tuple(p.shape[::-1]) if _transposed(p) else tuple(p.shape)


def _grads(params: list) -> list:
    """The params' grads, each laid out as its param: a row-major or transposed param's grad
    of other strides (as torch.optim.Muon takes it) as a copy in the param's layout, made on
    the caller's stream."""
    return [p.grad if p.grad.stride() == p.stride() else torch.empty_like(p).copy_(p.grad)
            for p in params]


def _lr_ratio(adjust_lr_fn, shape) -> float:
    """torch.optim.Muon's lr adjustment for a (rows, cols) matrix."""
    rows, cols = shape[:2]
    if adjust_lr_fn in (None, "original"):
        return math.sqrt(max(1.0, rows / cols))
    return 0.2 * math.sqrt(max(rows, cols))  # match_rms_adamw


def _lr_value(lr):
    if isinstance(lr, torch.Tensor):
        return float(lr) if lr.device.type == "cpu" else lr.reshape(())
    return float(lr)


def _check_group(where: str, group) -> None:
    use_muon = group.get("use_muon", True)
    if not isinstance(use_muon, bool):
        raise TypeError(f"{where}use_muon must be True or False, got {use_muon!r}")
    if not use_muon:
        betas = group["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{where}betas must be a pair (beta1, beta2), got {betas!r}")
        for i, beta in enumerate(betas):
            check_number(f"{where}betas[{i}]", beta, low=0.0, high=1.0, high_open=True)
        for name in ("maximize", "amsgrad"):
            if group.get(name, False):
                raise ValueError(f"{where}{name}=True in a use_muon=False group: its AdamW takes "
                                 f"lr, betas, eps and weight_decay only; step these params with "
                                 f"a mtapply.torch.AdamW({name}=True) of their own")
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}Tensor lr must be 1-element")
        if lr.device.type != "cpu" and lr.dtype != torch.float32:
            raise TypeError(f"{where}a CUDA lr tensor must be float32 (the kernels read it "
                            f"there), got {lr.dtype}")
    else:
        check_number(f"{where}lr", lr, low=0.0)
    check_number(f"{where}momentum", group["momentum"], low=0.0)
    check_number(f"{where}weight_decay", group["weight_decay"], low=0.0)
    check_number(f"{where}eps", group["eps"], low=0.0)
    steps = group["ns_steps"]
    if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
        raise ValueError(f"{where}ns_steps must be a whole number below 100 (for computational "
                         f"efficiency, as torch.optim.Muon), got {steps!r}")
    coefficients = group["ns_coefficients"]
    if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3:
        raise ValueError(f"{where}ns_coefficients must be a tuple of exactly 3 values (a, b, c), "
                         f"got {coefficients!r}")
    for name, value in zip("abc", coefficients):
        check_number(f"{where}ns_coefficients {name}", value)
    if group["adjust_lr_fn"] not in ADJUST_LR_FNS:
        raise ValueError(f"{where}Adjust learning rate function {group['adjust_lr_fn']} is not "
                         f"supported: use None, 'original' or 'match_rms_adamw'")


def _check_matrices(index: int, group) -> None:
    for i, p in enumerate(group["params"]):
        if not group.get("use_muon", True):
            if p.is_complex() or not p.is_floating_point():
                raise TypeError(f"param group {index}: param {i} is {p.dtype}: mtapply's AdamW "
                                f"steps real floating params")
            continue
        if p.ndim != 2:
            raise ValueError(f"Muon only supports 2D parameters whereas we found a parameter with "
                             f"size: {p.size()} (param group {index}, param {i}): give it to "
                             f"an AdamW")
        if not p.is_floating_point() and not p.is_complex():  # (complex: refused at the step)
            raise TypeError(f"param group {index}: param {i} is {p.dtype}: Muon steps "
                            f"floating params")
