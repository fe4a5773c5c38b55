"""Plan.count_steps on the CPU backend: the plan reads its counter plus one as the step and
advances it after each step that found_inf does not skip."""
import numpy as np
import pytest

import mtapply


def _adam_lists(seed: int, shapes=((5,), (3, 4), (0,))):
    rng = np.random.default_rng(seed)
    make = lambda scale=1.0: [(rng.standard_normal(s) * scale).astype(np.float32)  # noqa: E731
                              for s in shapes]
    return make(), make(), make(0.1), [np.abs(v) for v in make(0.01)]


def test_counted_steps_equal_explicit_steps():
    lists = _adam_lists(1)
    twin = [[a.copy() for a in column] for column in lists]
    counter = np.full(1, 3.0, np.float32)
    plan = mtapply.adam_plan(*lists, decoupled_weight_decay=True)
    plan.count_steps(counter)
    explicit = mtapply.adam_plan(*twin, decoupled_weight_decay=True)
    for t in range(4, 8):
        plan.step(lr=1e-2, weight_decay=0.1)
        explicit.step(lr=1e-2, step=t, weight_decay=0.1)
    assert counter[0] == 7.0
    for a, b in zip(lists[0], twin[0]):
        np.testing.assert_array_equal(a, b)


def test_found_inf_skips_the_count_and_the_counter_may_be_passed_as_step():
    lists = _adam_lists(2)
    twin = [[a.copy() for a in column] for column in lists]
    counter = np.zeros(1, np.float32)
    found_inf = np.zeros(1, np.float32)
    plan = mtapply.adam_plan(*lists)
    plan.count_steps(counter)
    for flag in (0.0, 1.0, 0.0):
        found_inf[0] = flag
        plan.step(lr=1e-2, step=counter, found_inf=found_inf)
    assert counter[0] == 2.0
    explicit = mtapply.adam_plan(*twin)
    for t in (1, 2):
        explicit.step(lr=1e-2, step=t)
    for a, b in zip(lists[0], twin[0]):
        np.testing.assert_array_equal(a, b)


def test_a_plan_without_tensors_still_counts():
    counter = np.zeros(1, np.float32)
    plan = mtapply.adam_plan([], [], [], [])
    plan.count_steps(counter)
    plan.step(lr=1e-2)
    plan.step(lr=1e-2, found_inf=1.0)
    assert counter[0] == 1.0


def test_refusals_name_the_argument_and_change_nothing():
    lists = _adam_lists(3)
    before = [a.copy() for a in lists[0]]
    plan = mtapply.adam_plan(*lists)
    with pytest.raises(ValueError, match="counter must be a writable one-element float32"):
        plan.count_steps(np.zeros(1, np.float64))
    with pytest.raises(ValueError, match="counter must be a writable one-element float32"):
        plan.count_steps(np.zeros(2, np.float32))
    frozen = np.zeros(1, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="counter must be a writable"):
        plan.count_steps(frozen)
    counter = np.zeros(1, np.float32)
    plan.count_steps(counter)
    with pytest.raises(ValueError, match="step: this plan counts its steps"):
        plan.step(lr=1e-2, step=1)
    with pytest.raises(ValueError, match="lr"):
        plan.step(lr=-1.0)
    assert counter[0] == 0.0
    for a, b in zip(lists[0], before):
        np.testing.assert_array_equal(a, b)
    norms = mtapply.Plan(mtapply.ops.L2NormSpec(), {"tensors": lists[0]})
    with pytest.raises(ValueError, match="takes no step count"):
        norms.count_steps(counter)
