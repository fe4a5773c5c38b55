"""A quadratic for the optimizers that estimate their own step size (Prodigy, D-Adaptation):
grads p - target point the same way every step, so the estimate grows from d0."""
import numpy as np

SHAPES = [(5, 4), (4,), (0,), (30,)]


def problem(seed):
    """(params, targets) as float64 NumPy arrays."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s) for s in SHAPES], [rng.standard_normal(s) for s in SHAPES]


def torch_problem(torch, seed=0, dtype=None):
    """The same as torch Parameters and tensors."""
    params, targets = problem(seed)
    dtype = dtype or torch.float64
    return ([torch.nn.Parameter(torch.tensor(p, dtype=dtype)) for p in params],
            [torch.tensor(y, dtype=dtype) for y in targets])


def torch_run(opt, params, targets, steps, missed=frozenset()):
    """`steps` steps; param i has no grad at step k where (k, i) is in `missed`."""
    for k in range(steps):
        for i, (p, y) in enumerate(zip(params, targets)):
            p.grad = None if (k, i) in missed else p.detach() - y
        opt.step()


def assert_equals_peer(torch, ours_class, theirs_class, variants, dtype, rel,
                       missed=frozenset()) -> None:
    """100 steps of the quadratic with our optimizer and its peer, for each option set: each
    param within `rel` of the peer's (relative to its norm), the estimate d within 2e-6 in
    float32 (its sums and scalar state are float32 there), within `rel` in float64. `missed`:
    (step, param index) pairs where that param has no grad."""
    import pytest

    for options in variants:
        ours, targets = torch_problem(torch, 2, getattr(torch, dtype))
        theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        a, b = ours_class(ours, **options), theirs_class(theirs, **options)
        torch_run(a, ours, targets, 100, missed)
        torch_run(b, theirs, targets, 100, missed)
        for p, q in zip(ours, theirs):
            gap = float((p - q).norm())
            assert gap <= rel * float(q.norm()), (options, gap / float(q.norm()))
        assert a.state[ours[0]]["d"].dtype == getattr(torch, dtype)
        d_rel = 2e-6 if dtype == "float32" else rel
        assert float(a.state[ours[0]]["d"]) == pytest.approx(b.param_groups[0]["d"], rel=d_rel)
