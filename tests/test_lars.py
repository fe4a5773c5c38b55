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


def test_spec_is_the_library_rule_in_two_passes_sharing_one_table():
    from mtapply.rules import library

    spec = mtapply.LARSSpec()
    assert spec.program is library.lars().program
    assert len(spec.functors) == 2 and spec.functors[0].endswith("Sums") and spec.n_sums == 2
    assert spec.tensor_arrays(3) == {} and spec.arguments(lr=0.1)["adapt"] == 1.0
    excluding = mtapply.LARSSpec(exclude=[False, True, False])
    arrays = excluding.tensor_arrays(3)
    assert arrays["adapt_array"].tolist() == arrays["decay_on_array"].tolist() == [1.0, 0.0, 1.0]
    assert "adapt" not in excluding.arguments(lr=0.1)
    with pytest.raises(ValueError, match="exclude has 3 entries but params has 2"):
        excluding.tensor_arrays(2)


def test_rule_values_given_per_tensor_are_checked_against_their_range():
    from mtapply.rules import library
    from mtapply.rules._spec import RuleSpec

    with pytest.raises(ValueError, match=r"adapt\[1\] must be"):
        RuleSpec("lars", library.lars().program, tensor_values={"adapt": [1.0, 2.0]})
    with pytest.raises(ValueError, match="no hyperparameter 'nope'"):
        RuleSpec("lars", library.lars().program, tensor_values={"nope": [1.0]})
