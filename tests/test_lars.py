"""LARS specifics: excluded tensors, zero norms, and the two-launch structure."""
import numpy as np
import pytest

import mtapply

HYPER = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.02, eps=1e-8)


def _lists(shapes, rng):
    return ([rng.standard_normal(s).astype(np.float32) for s in shapes],
            [rng.standard_normal(s).astype(np.float32) for s in shapes],
            [0.01 * rng.standard_normal(s).astype(np.float32) for s in shapes])


def test_excluded_tensors_take_plain_momentum_steps():
    rng = np.random.default_rng(0)
    params, grads, buffers = _lists([(30,), (5,), (40,)], rng)
    before = [[a.astype(np.float64) for a in column] for column in (params, grads, buffers)]
    mtapply.lars_step(params, grads, buffers, exclude=[False, True, False], **HYPER)
    for i, adapt in enumerate([True, False, True]):
        p, v = mtapply.reference.lars(before[0][i], before[1][i], before[2][i], adapt=adapt, **HYPER)
        np.testing.assert_allclose(params[i], p, rtol=1.3e-6, atol=1e-6)
        np.testing.assert_allclose(buffers[i], v, rtol=1.3e-6, atol=1e-6)
    # excluded: local lr is lr itself and there is no weight decay
    v1 = 0.9 * before[2][1] + 0.1 * before[1][1]
    np.testing.assert_allclose(buffers[1], v1, rtol=1e-6, atol=1e-7)


def test_zero_norm_falls_back_to_lr():
    params = [np.zeros(8, np.float32), np.ones(8, np.float32)]
    grads = [np.ones(8, np.float32), np.zeros(8, np.float32)]
    buffers = [np.zeros(8, np.float32), np.zeros(8, np.float32)]
    mtapply.lars_step(params, grads, buffers, lr=0.5, momentum=0.0, weight_decay=0.0)
    np.testing.assert_allclose(params[0], -0.5)  # ||p|| = 0: lr applies to the gradient
    np.testing.assert_allclose(params[1], 1.0)   # ||g|| = 0: lr times a zero gradient


def test_exclude_must_have_one_flag_per_param():
    rng = np.random.default_rng(1)
    params, grads, buffers = _lists([(3,), (4,)], rng)
    before = [p.copy() for p in params]
    with pytest.raises(ValueError, match="exclude has 1 entries but params has 2"):
        mtapply.lars_step(params, grads, buffers, exclude=[True], **HYPER)
    for a, b in zip(params, before):
        np.testing.assert_array_equal(a, b)


def test_spec_declares_two_passes_sharing_one_table():
    spec = mtapply.LARSSpec()
    assert spec.functors == ("mta::LarsNorms", "mta::Lars") and spec.n_sums == 2
    assert spec.tensor_arrays(3)["adapt_array"].tolist() == [1.0, 1.0, 1.0]
