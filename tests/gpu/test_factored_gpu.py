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

pytestmark = pytest.mark.gpu

# (257, 300): ragged tiles, more of them than the tensor's blocks (kernels/factored.cuh)
SHAPES = [(64, 48), (3, 40, 50), (5,), (1, 300), (300, 1), (1024, 768), (257, 300)]
SLOTS = ("row_var", "col_var", "variance")


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


def _guarded(shapes, fill, guard: int = 64):
    """Tensors of these shapes lying in one NaN-filled buffer, `guard` elements apart; with
    the buffer, to check that nothing around them was written."""
    sizes = [int(np.prod(s)) for s in shapes]
    buffer = torch.full((sum(sizes) + guard * (len(sizes) + 1),), float("nan"), device="cuda")
    views, at = [], guard
    for shape, size in zip(shapes, sizes):
        views.append(buffer[at:at + size].view(shape))
        views[-1].copy_(fill(shape))
        at += size + guard
    return buffer, views


def _rule_lists(rule, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def values(shape):
        return torch.randn(shape, generator=gen).abs() + 0.1

    shapes = [rule.state_shapes(s) for s in SHAPES]
    lists = [_guarded(SHAPES, values), _guarded(SHAPES, values)]
    lists += [_guarded([s[name] for s in shapes], values) for name in SLOTS]
    return lists


def test_the_rule_step_matches_its_numpy_step_and_writes_nothing_outside_its_tensors():
    rule = library.adafactor()
    lists = _rule_lists(rule, seed=2)
    cpu = [[v.cpu().clone() for v in views] for _, views in lists]
    buffers = [buffer for buffer, _ in lists]
    inside = [torch.zeros_like(b, dtype=torch.bool) for b in buffers]
    for k, (buffer, views) in enumerate(lists):
        for view in views:
            offset = view.data_ptr() - buffer.data_ptr()
            inside[k][offset // 4:offset // 4 + view.numel()] = True
    hyper = dict(lr=1e-2, eps1=1e-30, step=3)
    rule.step(*(views for _, views in lists), **hyper)
    rule.step(*cpu, **hyper)
    names = ("params", "grads") + SLOTS
    for k, (name, (buffer, views)) in enumerate(zip(names, lists)):
        guards = buffer[~inside[k]]
        assert torch.isnan(guards).all(), f"{name}: an element outside its tensors was written"
        _assert_close([(f"{name}[{i}] (shape {tuple(v.shape)})", v, c)
                       for i, (v, c) in enumerate(zip(views, cpu[k])) if v.numel()])


def test_the_step_is_the_same_bits_every_run():
    rule = library.adafactor()
    results = []
    for _ in range(2):
        lists = _rule_lists(rule, seed=3)
        for step in (1, 2, 3):
            rule.step(*(views for _, views in lists), lr=1e-2, eps1=1e-30, step=step)
        results.append([buffer.cpu() for buffer, _ in lists])
    for k, (first, second) in enumerate(zip(*results)):
        same = torch.equal(first.nan_to_num(7.0), second.nan_to_num(7.0))
        assert same, f"{('params', 'grads', *SLOTS)[k]} differs between two runs"


def test_8_bit_momentum_beside_factored_slots_is_refused_on_a_gpu_before_any_write():
    rule = library.adafactor_optax(momentum=True).with_state_bits(8, slots=("ema",), threshold=1)
    gen = torch.Generator("cuda").manual_seed(3)
    params = [torch.randn(s, device="cuda", generator=gen) for s in [(300, 260), (7,)]]
    grads = [torch.randn(p.shape, device="cuda", generator=gen) for p in params]
    state = rule.state(params, min_dim_size=128)
    before = [t.clone() for t in (*params, *(x for column in state for x in column))]
    with pytest.raises(NotImplementedError, match=r"8-bit slots \(ema\) beside factored slots"):
        rule.step(params, grads, *state, lr=0.01, decay=0.5, momentum=0.9)
    after = [*params, *(x for column in state for x in column)]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
