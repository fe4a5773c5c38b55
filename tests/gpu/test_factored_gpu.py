"""Rules with factored slots (Adafactor) on a GPU: mtapply.torch.Adafactor against
torch.optim.Adafactor over matrices, a batch of matrices, vectors and thin matrices in one list;
the rule's step against its NumPy step, writing nothing outside its tensors (NaN guards around
each) and the same bits every run (mtapply.optax.adafactor on a GPU: test_optax_ffi_gpu.py)."""
import numpy as np
import pytest

from mtapply.rules import library

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import mtapply.torch as mt  # noqa: E402
from _helpers import count_launches, on_gpu_at  # noqa: E402

pytestmark = pytest.mark.gpu

# (257, 300): ragged tiles, more of them than the tensor's blocks (kernels/factored.cuh)
SHAPES = [(64, 48), (3, 40, 50), (5,), (1, 300), (300, 1), (1024, 768), (257, 300)]
SLOTS = ("row_var", "col_var", "variance")
# The combine and matrix passes' cases (kernels/factored.cuh), launched over the blocks with
# work only: rows of 33 column groups and columns of 34 row groups (a warp each), a stack of
# more matrices than blocks (a warp a matrix) and one of fewer (a block a matrix), and a
# matrix whose rows need more blocks than it has.
WIDE_SHAPES = [(9, 4200), (5,), (17000, 40), (40, 30, 20), (4, 200, 300), (3000, 200)]
# Whole-row tiles, which take the sums' product forms (kernels/factored.cuh, factor_rows): rows
# of one vector a thread (768: 192 threads a row, 64 idle; 128 and 384: several rows a trip),
# of two and three (1152, 3072), ragged tiles (100 rows of 42-row tiles), a stack, one row;
# beside matrices of too many columns (3200), of columns no whole warps share (1408 = 4 x 32 x
# 11) and of columns no multiple of 128.
ROW_SHAPES = [(100, 768), (3, 50, 256), (1, 3072), (70, 1152), (600, 128), (33, 384),
              (17, 3200), (64, 48), (5,), (2, 1024), (9, 1408)]


def _mismatch(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float):
    """None, or a message naming the tensor, the worst element's index and both values."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    error = (got - want).abs() - rtol * want.abs()
    if not torch.isfinite(got).all():
        bad = torch.nonzero(~torch.isfinite(got))[0].tolist()
        return f"{name}{bad}: {got[tuple(bad)].item()!r} is not finite"
    if error.numel() and error.max().item() > atol:
        index = np.unravel_index(int(error.argmax()), tuple(got.shape))
        return (f"{name}{list(index)}: {got[index].item()!r}, expected {want[index].item()!r} "
                f"(rtol {rtol}, atol {atol})")
    return None


def _assert_close(pairs, rtol=1e-5, atol=1e-7):
    problems = [m for m in (_mismatch(*pair, rtol, atol) for pair in pairs) if m]
    assert not problems, "\n".join(problems)


def _params(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).cuda() for s in SHAPES]


@pytest.mark.parametrize("weight_decay,maximize", [(0.0, False), (0.1, True)])
def test_torch_adafactor_follows_torch_optim(weight_decay, maximize):
    start = _params()
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    kwargs = dict(lr=1e-2, weight_decay=weight_decay, maximize=maximize)
    opt, ref = mt.Adafactor(ours, **kwargs), torch.optim.Adafactor(theirs, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for step in range(20):
        for p, q in zip(ours, theirs):
            grad = torch.randn(p.shape, generator=gen).cuda()
            p.grad, q.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
        pairs = [(f"step {step + 1}: params[{i}]", p, q) for i, (p, q) in enumerate(zip(ours, theirs))]
        for i, (p, q) in enumerate(zip(ours, theirs)):
            for name in SLOTS:
                if name in ref.state[q] and ref.state[q][name].numel():
                    pairs.append((f"step {step + 1}: {name}[{i}] (shape {tuple(p.shape)})",
                                  opt.state[p][name], ref.state[q][name]))
        _assert_close(pairs)


def test_bfloat16_factored_and_unfactored_params_share_each_pass_launch():
    """Their empty slots take the dtype of the kept ones: one launch a pass for the list (five),
    not one per kind of param; the steps stay within a bfloat16 rounding of torch's."""
    start = [p.to(torch.bfloat16) for p in _params(4)]
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opt, ref = mt.Adafactor(ours, lr=1e-2), torch.optim.Adafactor(theirs, lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    launches = []
    for _ in range(4):
        for p, q in zip(ours, theirs):
            grad = torch.randn(p.shape, generator=gen).cuda().to(torch.bfloat16)
            p.grad, q.grad = grad.clone(), grad.clone()
        launches.append(count_launches(opt.step))
        ref.step()
    assert launches[1:] == [5, 5, 5]
    for i, (p, q) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=1e-2, atol=2e-2,
                                   msg=lambda m, i=i: f"params[{i}] {tuple(p.shape)}: {m}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_grad_makes_torchs_nans(bad):
    """The estimate's clamps keep a NaN on the GPU as torch's do: the same elements are NaN,
    the others torch's values."""
    start = _params(2)
    ours = [torch.nn.Parameter(p.clone()) for p in start]
    theirs = [torch.nn.Parameter(p.clone()) for p in start]
    opt, ref = mt.Adafactor(ours, lr=1e-2), torch.optim.Adafactor(theirs, lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    for p, q in zip(ours, theirs):
        grad = torch.randn(p.shape, generator=gen).cuda()
        grad.view(-1)[min(1, grad.numel() - 1)] = bad
        p.grad, q.grad = grad.clone(), grad.clone()
    opt.step()
    ref.step()
    for i, (p, q) in enumerate(zip(ours, theirs)):
        assert q.isnan().any(), i
        assert torch.equal(p.isnan(), q.isnan()), i
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-7, equal_nan=True)


def _guarded(shapes, fill, guard: int = 64, dtype=torch.float32, align: int = 1):
    """Tensors of these shapes lying in one NaN-filled buffer, `guard` elements apart (each
    starting at a multiple of `align` elements); with the buffer, to check that nothing around
    them was written."""
    sizes = [int(np.prod(s)) for s in shapes]
    room = sum(sizes) + (guard + align) * (len(sizes) + 1)
    buffer = torch.full((room,), float("nan"), device="cuda", dtype=dtype)
    views, at = [], guard
    for shape, size in zip(shapes, sizes):
        views.append(buffer[at:at + size].view(shape))
        views[-1].copy_(fill(shape))
        at = -(-(at + size + guard) // align) * align
    return buffer, views


def _rule_lists(rule, seed: int, params=SHAPES, **layout):
    gen = torch.Generator().manual_seed(seed)

    def values(shape):
        return torch.randn(shape, generator=gen).abs() + 0.1

    shapes = [rule.state_shapes(s) for s in params]
    lists = [_guarded(params, values, **layout), _guarded(params, values, **layout)]
    lists += [_guarded([s[name] for s in shapes], values, **layout) for name in SLOTS]
    return lists


def _inside(buffer, views):
    """Where the views lie in their buffer."""
    inside = torch.zeros_like(buffer, dtype=torch.bool)
    for view in views:
        offset = (view.data_ptr() - buffer.data_ptr()) // buffer.element_size()
        inside[offset:offset + view.numel()] = True
    return inside


@pytest.mark.parametrize("shapes", [SHAPES, WIDE_SHAPES, ROW_SHAPES], ids=["shapes", "wide", "rows"])
def test_the_rule_step_matches_its_numpy_step_and_writes_nothing_outside_its_tensors(shapes):
    rule = library.adafactor()
    lists = _rule_lists(rule, 2, shapes)
    cpu = [[v.cpu().clone() for v in views] for _, views in lists]
    inside = [_inside(buffer, views) for buffer, views in lists]
    hyper = dict(lr=1e-2, eps1=1e-30, step=3)
    rule.step(*(views for _, views in lists), **hyper)
    rule.step(*cpu, **hyper)
    names = ("params", "grads") + SLOTS
    for k, (name, (buffer, views)) in enumerate(zip(names, lists)):
        guards = buffer[~inside[k]]
        assert torch.isnan(guards).all(), f"{name}: an element outside its tensors was written"
        _assert_close([(f"{name}[{i}] (shape {tuple(v.shape)})", v, c)
                       for i, (v, c) in enumerate(zip(views, cpu[k])) if v.numel()])


@pytest.mark.parametrize("case", ["clamp", "zero-rows", "nan"])
def test_sums_whose_product_forms_fail_are_taken_over_the_elements(case):
    """Where a product form's checks fail in a matrix (torch's clamp v >= eps1^2 bites in some
    rows; rows of zero state and grads; a NaN grad), the sums pass takes that tensor's sums over
    its elements: the step is still the NumPy step's."""
    rule = library.adafactor()
    lists = _rule_lists(rule, 5, ROW_SHAPES)
    params, grads, row_var, col_var, _ = (views for _, views in lists)
    eps1 = 1e-30
    if case == "clamp":  # the first 10 rows of (100, 768): v far below eps1^2 = 1e-6
        eps1 = 1e-3
        grads[0][:10].mul_(1e-5)
        row_var[0][:10].mul_(1e-10)
    elif case == "zero-rows":  # (eps1^2 above float32's smallest: v is clamped, not 0)
        eps1 = 1e-3
        grads[0][3:5].zero_()
        row_var[0][3:5].zero_()
    else:
        grads[3][7, 11] = float("nan")
    cpu = [[v.cpu().clone() for v in views] for _, views in lists]
    hyper = dict(lr=1e-2, eps1=eps1, step=3)
    rule.step(*(views for _, views in lists), **hyper)
    rule.step(*cpu, **hyper)
    for k, (name, (_, views)) in enumerate(zip(("params", "grads") + SLOTS, lists)):
        for i, (v, c) in enumerate(zip(views, cpu[k])):
            if not v.numel():
                continue
            if case == "nan" and i == 3:
                assert torch.equal(v.cpu().isnan(), c.isnan()), f"{name}[{i}]"
                v, c = v.cpu().nan_to_num(7.0), c.nan_to_num(7.0)
            _assert_close([(f"{name}[{i}] (shape {tuple(v.shape)})", v, c)])


@pytest.mark.parametrize("momentum", [False, True])
def test_optax_rule_takes_its_sums_from_whole_rows(momentum):
    """optax's form (clipping by RMS(u), the param scale): its two sums' product forms over
    whole rows, against the NumPy step."""
    rule = library.adafactor_optax(momentum=momentum)
    shapes = ROW_SHAPES
    gen = torch.Generator().manual_seed(9)
    def start(name, shape):  # (the average starts at 0, as a step's state does)
        if name in ("param", "grad"):
            return torch.randn(shape, generator=gen)
        if name == "ema":
            return torch.zeros(rule.state_shapes(shape)[name])
        return torch.randn(rule.state_shapes(shape)[name], generator=gen).abs() + 0.1

    values = [[start(name, s) for s in shapes] for name in
              ("param", "grad", "row_var", "col_var", "variance") + (("ema",) if momentum else ())]
    gpu = [[v.cuda() for v in vs] for vs in values]
    hyper = dict(lr=1e-2, decay=0.8, **({"momentum": 0.9} if momentum else {}))
    for step in (1, 2):
        rule.step(*gpu, step=step, **hyper)
        rule.step(*values, step=step, **hyper)
    for k, (g, c) in enumerate(zip(gpu, values)):
        _assert_close([(f"slot {k}[{i}]", a, b) for i, (a, b) in enumerate(zip(g, c)) if a.numel()])


# 16-bit data in the factor pass (kernels/factored.cuh, factor_walk): vectors of 8 elements where
# cols is a multiple of 8 (257 rows: the second row of a warp's last pair lies past the tile; 40
# columns: lanes past the tile's last column; a stack), of 4 where it is 4 mod 8, single elements
# for odd cols, and a vector's full variance
# (700, 88): tiles of 96 columns and 341 rows, an odd count of two-row sets; (40, 256): whole-row
# tiles, whose sums the factor pass takes from the unscaled values
NARROW_SHAPES = [(257, 264), (70, 40), (3, 41, 136), (33, 300), (65, 301), (700, 88), (40, 256),
                 (6,)]


@pytest.mark.parametrize("align", [8, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_lists_follow_the_float32_step_of_their_values(dtype, align):
    """Each result within one rounding to the dtype of the step taken in float32 on the CPU
    from the same values (AMP's grad scale of 4 divided out where the values are loaded), and
    nothing written around the tensors; unaligned tensors take the single-element reads."""
    rule = library.adafactor()
    lists = _rule_lists(rule, 4, NARROW_SHAPES, dtype=dtype, align=align)
    cpu = [[v.cpu().float() for v in views] for _, views in lists]
    for grad in cpu[1]:
        grad /= 4.0  # the CPU step takes the unscaled grads (powers of 2: exact)
    hyper = dict(lr=1e-2, eps1=1e-30, step=3)
    rule.step(*(views for _, views in lists), grad_scale=4.0, **hyper)
    rule.step(*cpu, **hyper)
    for grad in cpu[1]:
        grad *= 4.0  # the grads as given, which the step leaves as they are
    rounding = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    for k, (name, (buffer, views)) in enumerate(zip(("params", "grads") + SLOTS, lists)):
        assert torch.isnan(buffer[~_inside(buffer, views)]).all(), f"{name}: a guard was written"
        _assert_close([(f"{name}[{i}] (shape {tuple(v.shape)})", v, c.to(dtype))
                       for i, (v, c) in enumerate(zip(views, cpu[k])) if v.numel()],
                      rtol=rounding, atol=1e-6)


def test_16_bit_steps_are_the_same_bits_every_run():
    rule = library.adafactor()
    results = []
    for _ in range(2):
        lists = _rule_lists(rule, 5, NARROW_SHAPES, dtype=torch.bfloat16, align=8)
        for step in (1, 2, 3):
            rule.step(*(views for _, views in lists), lr=1e-2, eps1=1e-30, step=step)
        results.append([buffer.cpu() for buffer, _ in lists])
    for k, (first, second) in enumerate(zip(*results)):
        assert torch.equal(first.float().nan_to_num(7.0), second.float().nan_to_num(7.0)), k


@pytest.mark.parametrize("shapes", [SHAPES, WIDE_SHAPES, ROW_SHAPES], ids=["shapes", "wide", "rows"])
def test_the_step_is_the_same_bits_every_run(shapes):
    rule = library.adafactor()
    results = []
    for _ in range(2):
        lists = _rule_lists(rule, 3, shapes)
        for step in (1, 2, 3):
            rule.step(*(views for _, views in lists), lr=1e-2, eps1=1e-30, step=step)
        results.append([buffer.cpu() for buffer, _ in lists])
    for k, (first, second) in enumerate(zip(*results)):
        same = torch.equal(first.nan_to_num(7.0), second.nan_to_num(7.0))
        assert same, f"{('params', 'grads', *SLOTS)[k]} differs between two runs"


# 8-bit momentum beside factored slots (min_dim_size 128, threshold 1000): factored matrices
# (a stack, a ragged one whose last quantization block is cut), a matrix below min_dim_size
# that keeps a full variance, a long vector, a short one that keeps float32 state, and a
# matrix of whole-row tiles (384 columns: its sums from the factor pass, the 8-bit walk's sums
# pass skipping it)
EIGHT_SHAPES = [(300, 260), (3, 130, 140), (257, 300), (100, 120), (5000,), (7,), (260, 384)]
EIGHT_HYPER = dict(lr=1e-2, decay=0.5, momentum=0.9, weight_decay=0.01)


def _eight_bit_adafactor():
    return library.adafactor_optax(momentum=True).with_state_bits(8, slots=("ema",),
                                                                  threshold=1000)


def _eight_bit_state(rule, params, rng):
    """The state lists at random values (never zeros): 8-bit momentum where `state` makes
    codes, positive second moments."""
    from mtapply import quantization

    columns = [list(c) for c in rule.state(params, min_dim_size=128)]
    for k in range(len(params)):
        for j in range(3):  # row_var, col_var, variance
            columns[j][k] = np.abs(rng.standard_normal(columns[j][k].shape)).astype(np.float32) + 0.01
        ema = (rng.standard_normal(params[k].shape) * 0.01).astype(np.float32)
        if columns[3][k].dtype == np.uint8:
            codes, columns[4][k] = quantization.quantize_blockwise(ema, True)
            columns[3][k] = codes.reshape(ema.shape)
        else:
            columns[3][k] = ema
    return columns


def _assert_8_bit_close(got_params, want_params, got_state, want_state, where):
    """Within the 8-bit walk's tolerances (tests/gpu/test_rule_state_bits_gpu.py): params and
    float state as float32 math allows, codes equal but for values on a midpoint."""
    lr = EIGHT_HYPER["lr"]
    for k, (p, w) in enumerate(zip(got_params, want_params)):
        got = p.float().cpu().numpy()
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=lr * 0.2, err_msg=f"{where} params[{k}]")
        assert np.isclose(got, w, rtol=1e-5, atol=1e-6).mean() >= 0.999, f"{where} params[{k}]"
    names = ("row_var", "col_var", "variance", "ema", "ema_absmax")
    for name, column, want_column in zip(names, got_state, want_state):
        for k, (x, w) in enumerate(zip(column, want_column)):
            got = x.cpu().numpy()
            if got.dtype == np.uint8:
                diff = np.abs(got.astype(int) - w.astype(int))
                assert diff.max(initial=0) <= 1 and (diff == 0).mean() >= 0.999, f"{where} {name}[{k}]"
            else:
                np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-7, err_msg=f"{where} {name}[{k}]")


@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_8_bit_momentum_beside_factored_slots_follows_the_numpy_step(offset):
    """optax's Adafactor rule with its momentum in 8 bits: the factored reductions, then the
    sums and the update on the 8-bit walk (indexed functors), against the rule's NumPy step
    from the same inputs at each step."""
    rule = _eight_bit_adafactor()
    rng = np.random.default_rng(5)
    params = [rng.standard_normal(s).astype(np.float32) for s in EIGHT_SHAPES]
    host = (params, _eight_bit_state(rule, params, rng))
    assert [c.dtype for c in host[1][3]] == [np.uint8] * 5 + [np.float32, np.uint8]
    # full variance: unfactored
    assert [c.size for c in host[1][2]] == [0, 0, 0, 12000, 5000, 7, 0]
    # each step from equal inputs: a code on a midpoint may round either way, and a block's
    # scale would carry it into later steps
    for t in range(1, 4):
        gpu = (on_gpu_at(host[0], offset), [on_gpu_at(c, offset) for c in host[1]])
        grads = [rng.standard_normal(s).astype(np.float32) for s in EIGHT_SHAPES]
        rule.step(gpu[0], on_gpu_at(grads, offset), *gpu[1], **EIGHT_HYPER)
        rule.step(host[0], grads, *host[1], **EIGHT_HYPER)
        torch.cuda.synchronize()
        _assert_8_bit_close(gpu[0], host[0], gpu[1], host[1], f"offset {offset} step {t}")


def test_8_bit_momentum_beside_factored_slots_with_bf16_params():
    rule = _eight_bit_adafactor()
    rng = np.random.default_rng(6)
    shapes = EIGHT_SHAPES[:2] + EIGHT_SHAPES[3:5]
    params = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)).to("cuda", torch.bfloat16)
              for s in shapes]
    host_params = [p.float().cpu().numpy() for p in params]
    state = rule.state(params, min_dim_size=128)
    host_state = [[x.cpu().numpy().copy() for x in c] for c in state]
    grads = [torch.randn(s, device="cuda").to(torch.bfloat16) for s in shapes]
    rule.step(params, grads, *state, **EIGHT_HYPER)
    rule.step(host_params, [g.float().cpu().numpy() for g in grads], *host_state, **EIGHT_HYPER)
    torch.cuda.synchronize()
    for k, (p, w) in enumerate(zip(params, host_params)):
        want = torch.from_numpy(w).to(torch.bfloat16).float().numpy()
        np.testing.assert_allclose(p.float().cpu().numpy(), want, rtol=1e-2, atol=1e-2, err_msg=str(k))
