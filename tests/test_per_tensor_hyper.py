"""Hyperparameters given per tensor (one value per tensor, as param groups make them): a step
with them equals the steps of each tensor's own hyperparameters, for the functional calls and
bound plans of Adam, AdamW, SGD, 8-bit AdamW, LARS and LAMB, with values that change between
steps; bad sequences are refused before anything is written."""
import numpy as np
import pytest

import mtapply
from mtapply._rows import rows_for
from mtapply.ops.adam import AdamSpec

SHAPES = [(7,), (3, 5), (64,), (2, 2), (300,)]


def _lists(seed, n_lists):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(np.float32) * (0.1 if k >= 2 else 1.0) for s in SHAPES]
            for k in range(n_lists)]


def _copy(lists):
    return [[x.copy() for x in column] for column in lists]


def _adam_state(seed):
    params, grads, m, v = _lists(seed, 4)
    return [params, grads, m, [np.abs(x) for x in v]]


def test_adamw_with_per_tensor_values_equals_each_tensor_alone():
    lr = [1e-3, 2e-3, 1e-3, 5e-4, 2e-3]
    weight_decay = [0.0, 0.01, 0.01, 0.0, 0.1]
    beta1 = [0.9, 0.8, 0.9, 0.9, 0.85]
    together, alone = _adam_state(0), _adam_state(0)
    for t in (1, 2, 3):
        mtapply.adam_step(*together, lr=lr, step=t, beta1=beta1, weight_decay=weight_decay,
                          decoupled_weight_decay=True)
        for i in range(len(SHAPES)):
            mtapply.adam_step(*[[column[i]] for column in alone], lr=lr[i], step=t, beta1=beta1[i],
                              weight_decay=weight_decay[i], decoupled_weight_decay=True)
    for a, b in zip(sum(together, []), sum(alone, [])):
        np.testing.assert_array_equal(a, b)


def test_a_plan_follows_per_tensor_values_that_change_between_steps():
    together, alone = _adam_state(1), _adam_state(1)
    plan = mtapply.adam_plan(*together)
    plans = [mtapply.adam_plan(*[[column[i]] for column in alone]) for i in range(len(SHAPES))]
    for t in range(1, 5):
        lr = np.array([1e-3, 2e-3, 3e-3, 4e-3, 5e-3]) / t  # a scheduler per group
        eps = (1e-8,) * 3 + (1e-6, 1e-6)
        plan.step(lr=lr, step=t, eps=eps)
        for i, single in enumerate(plans):
            single.step(lr=float(lr[i]), step=t, eps=eps[i])
    for a, b in zip(sum(together, []), sum(alone, [])):
        np.testing.assert_array_equal(a, b)


def test_sgd_with_per_tensor_momentum_and_decay():
    params, grads, buffers = _lists(2, 3)
    twin = _copy([params, grads, buffers])
    momentum, weight_decay = [0.0, 0.9, 0.5, 0.9, 0.0], [0.0, 1e-3, 0.0, 1e-2, 1e-3]
    for t in (1, 2):
        mtapply.sgd_step(params, grads, buffers, lr=0.1, step=t, momentum=momentum,
                         weight_decay=weight_decay)
        for i in range(len(SHAPES)):
            mtapply.sgd_step([twin[0][i]], [twin[1][i]], [twin[2][i]], lr=0.1, step=t,
                             momentum=momentum[i], weight_decay=weight_decay[i])
    for a, b in zip(params + buffers, twin[0] + twin[2]):
        np.testing.assert_array_equal(a, b)


def test_adam8bit_with_per_tensor_learning_rates():
    rng = np.random.default_rng(3)
    params = [rng.standard_normal(s).astype(np.float32) for s in [(5000,), (12,), (4096,)]]
    twin = [p.copy() for p in params]
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    states = [mtapply.adam8bit_state(params), mtapply.adam8bit_state(twin)]
    lr = [1e-3, 3e-3, 2e-3]
    mtapply.adam8bit_step(params, grads, *states[0].lists(), lr=lr, step=1)
    for i in range(3):
        columns = [[column[i]] for column in states[1].lists()]
        mtapply.adam8bit_step([twin[i]], [grads[i]], *columns, lr=lr[i], step=1)
    for a, b in zip(params + sum(map(list, states[0].lists()), []),
                    twin + sum(map(list, states[1].lists()), [])):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("lr,message", [([1e-3, 1e-3], "lr has 2 values for 5 tensors"),
                                        ([1e-3, 1e-3, -1.0, 1e-3, 1e-3], "lr"),
                                        ([1e-3, "a", 1e-3, 1e-3, 1e-3], "must hold numbers")])
def test_bad_per_tensor_values_are_refused_before_anything_is_written(lr, message):
    lists = _adam_state(4)
    before = _copy(lists)
    with pytest.raises((ValueError, TypeError), match=message):
        mtapply.adam_step(*lists, lr=lr, step=1)
    for a, b in zip(sum(lists, []), sum(before, [])):
        np.testing.assert_array_equal(a, b)


def test_lars_and_lamb_with_per_tensor_values_equal_each_tensor_alone():
    """Their per-tensor norms are each tensor's own, so per-tensor values are too."""
    lr, decay = [0.1, 0.2, 0.05, 0.1, 0.3], [0.0, 1e-2, 1e-2, 0.0, 1e-3]
    lars_together, lars_alone = _lists(5, 3), _lists(5, 3)
    lamb_together, lamb_alone = _adam_state(6), _adam_state(6)
    for t in (1, 2):
        mtapply.lars_step(*lars_together, lr=lr, weight_decay=decay, momentum=0.9,
                          exclude=[False, True, False, False, True])
        mtapply.lamb_step(*lamb_together, lr=lr, step=t, weight_decay=decay,
                          max_grad_norm=[0.0, 1.0, 0.5, 0.0, 2.0], global_grad_norm=1.5)
        for i, (column, excluded) in enumerate(zip(zip(*lars_alone), [0, 1, 0, 0, 1])):
            mtapply.lars_step(*[[x] for x in column], lr=lr[i], weight_decay=decay[i],
                              momentum=0.9, exclude=[bool(excluded)])
        for i, column in enumerate(zip(*lamb_alone)):
            mtapply.lamb_step(*[[x] for x in column], lr=lr[i], step=t, weight_decay=decay[i],
                              max_grad_norm=[0.0, 1.0, 0.5, 0.0, 2.0][i], global_grad_norm=1.5)
    for a, b in zip(lars_together[0] + lamb_together[0], lars_alone[0] + lamb_alone[0]):
        np.testing.assert_array_equal(a, b)


def test_ops_that_sum_over_the_whole_list_take_one_value_for_all():
    with pytest.raises(TypeError, match="max_norm must be a Python number, got list"):
        mtapply.clip_grad_norm_(_lists(5, 1)[0], [1.0] * len(SHAPES))


def test_empty_lists_take_empty_per_tensor_values():
    mtapply.adam_step([], [], [], [], lr=[], step=1)
    with pytest.raises(ValueError, match="lr has 1 values for 0 tensors"):
        mtapply.adam_step([], [], [], [], lr=[1e-3], step=1)


def _rows(hyper, previous=None, n=4):
    return rows_for(AdamSpec(), hyper, n, lambda name, value: value, previous)


def test_rows_of_the_previous_step_are_reused_or_patched_while_the_values_allow():
    hyper = dict(lr=(1e-3, 2e-3, 1e-3, 2e-3), step=1, weight_decay=[0.0, 0.0, 0.1, 0.1])
    first = _rows(hyper)
    assert list(first.row_of) == [0, 1, 2, 3] and len(first.checked) == 4
    assert _rows(dict(hyper), first) is first  # the same tuple, an equal list
    assert _rows(dict(hyper, weight_decay=[0.0, 0.0, 0.1, 0.1]), first) is first
    # only lr changed, one value still per row: the rows are patched, not found again
    patched = _rows(dict(hyper, lr=[5e-4, 1e-3, 5e-4, 1e-3]), first)
    assert patched.origin is first and list(patched.patched["lr"]) == [5e-4, 1e-3, 5e-4, 1e-3]
    assert patched.checked == _rows(dict(hyper, lr=[5e-4, 1e-3, 5e-4, 1e-3])).checked
    again = _rows(dict(hyper, lr=[1.0, 1e-3, 5e-4, 1e-3]), patched)
    assert again.origin is first and again.checked[0]["lr"] == 1.0
    assert _rows(dict(hyper, lr=[1.0] * 4), first).origin is first  # equal rows may stay apart
    # rows that split, or another value changed: new rows
    assert _rows(dict(hyper, weight_decay=[0.0, 0.2, 0.1, 0.1]), first).origin is not first
    assert _rows(dict(hyper, eps=1e-6), first).origin is not first
    counted = _rows(dict(hyper, step=2), first)  # the step count is patched into every row
    assert counted.origin is first and [args["step"] for args in counted.checked] == [2.0] * 4
    merged = _rows(dict(hyper, lr=[1e-3] * 4, weight_decay=[0.1] * 4))
    assert list(merged.row_of) == [0, 0, 0, 0] and len(merged.checked) == 1
    split = _rows(dict(hyper, lr=[1e-3, 1e-3, 1e-3, 2e-3], weight_decay=[0.1] * 4), merged)
    assert split.origin is not merged and list(split.row_of) == [0, 0, 0, 1]


@pytest.mark.parametrize("lr", [[1e-3, -1.0, 1e-3, 1e-3], [1e-3, 1e-3, float("nan"), 1e-3]])
def test_a_patched_column_is_checked_and_names_the_tensor(lr):
    first = _rows(dict(lr=[1e-3, 2e-3, 3e-3, 4e-3], step=1))
    bad = lr.index(next(v for v in lr if not v >= 0))
    with pytest.raises(ValueError, match=f"tensor {bad}: lr"):
        _rows(dict(lr=lr, step=1), first)
    with pytest.raises(ValueError, match=f"tensor {bad}: lr"):
        _rows(dict(lr=lr, step=1))


def test_rows_split_across_devices_keep_their_origin_and_patches():
    """What a plan over several GPUs gives each device: the origin's rows (every row, the
    device's tensors' row numbers), and a later step's patches over that share."""
    first = _rows(dict(lr=[1e-3, 2e-3, 1e-3, 3e-3], step=1))
    share = first.subset(np.array([1, 3]))
    assert share.origin is share and list(share.row_of) == [1, 2]
    assert share.checked == first.checked and first.on(share) is share
    patched = _rows(dict(lr=[5e-4, 1e-3, 5e-4, 2e-3], step=1), first)
    on_share = patched.on(share)
    assert on_share.origin is share and list(on_share.row_of) == [1, 2]
    assert [args["lr"] for args in on_share.checked] == [5e-4, 1e-3, 2e-3]


def test_patched_values_inside_the_range_already_checked_are_not_checked_again(monkeypatch):
    """A scheduled value is checked against an interval of its own: the range of the values
    checked since the origin stands for every value inside it, so a decaying lr checks only
    its new minimum; a value outside is checked (and refused, naming the tensor)."""
    first = _rows(dict(lr=[1e-3, 2e-3, 3e-3, 4e-3], step=1))
    calls = []
    arguments = AdamSpec.arguments
    monkeypatch.setattr(AdamSpec, "arguments",
                        lambda self, **hyper: calls.append(hyper["lr"]) or arguments(self, **hyper))
    lower = _rows(dict(lr=[5e-4, 2e-3, 3e-3, 4e-3], step=1), first)
    assert sorted(calls) == [5e-4, 4e-3] and lower.origin is first
    calls.clear()
    inside = _rows(dict(lr=[6e-4, 1e-3, 2e-3, 3e-3], step=1), lower)
    assert calls == [] and list(inside.per_row("lr")) == [6e-4, 1e-3, 2e-3, 3e-3]
    decayed = _rows(dict(lr=[4e-4, 1e-3, 2e-3, 3e-3], step=1), inside)
    assert calls == [4e-4] and decayed.origin is first
    with pytest.raises(ValueError, match="tensor 2: lr"):
        _rows(dict(lr=[4e-4, 1e-3, -1.0, 3e-3], step=1), decayed)


def test_rows_hold_their_own_copy_of_each_column():
    """An array changed in place after a step is seen at the next one (the rows compare it
    with their own copy); the rows' numbers per row follow their patches."""
    lr = np.array([1e-3, 2e-3, 1e-3, 2e-3])
    first = _rows(dict(lr=lr, step=1, weight_decay=(0.0, 0.1, 0.0, 0.1)))
    assert first.holds_numbers("lr") and first.holds_numbers("step")
    assert not first.holds_numbers("eps")  # not given
    lr *= 0.5
    patched = _rows(dict(lr=lr, step=1, weight_decay=(0.0, 0.1, 0.0, 0.1)), first)
    assert patched is not first and patched.origin is first
    assert list(patched.per_row("lr")) == [5e-4, 1e-3]
    assert list(first.per_row("lr")) == [1e-3, 2e-3] and list(patched.per_row("step")) == [1, 1]


def test_device_values_per_tensor_make_rows_by_their_identity():
    """Per-tensor device values (each group's lr tensor): a row per distinct object, the
    values unread; the same objects again keep the rows, another object finds them again."""
    from mtapply.ops._spec import DeviceScalar

    d1, d2 = DeviceScalar(ptr=64, obj=None), DeviceScalar(ptr=128, obj=None)
    hyper = dict(lr=(d1, d1, d2, 1e-3), step=1, weight_decay=(0.0, 0.0, 0.0, 0.1))
    first = _rows(hyper)
    assert list(first.row_of) == [0, 0, 1, 2]
    assert [args["lr"] for args in first.checked] == [d1, d2, 1e-3]
    assert not first.holds_numbers("lr") and first.holds_numbers("step")
    assert _rows(dict(hyper, lr=[d1, d1, d2, 1e-3]), first) is first
    other = DeviceScalar(ptr=128, obj=None)  # equal, but another object
    again = _rows(dict(hyper, lr=(d1, d1, other, 1e-3)), first)
    assert again.origin is again and again.checked[1]["lr"] is other
    with pytest.raises(TypeError, match=r"lr\[1\] is a str"):
        _rows(dict(hyper, lr=(d1, "x", d2, 1e-3)))


def test_array_like_device_values_are_kept_as_they_are():
    """A column of one-element arrays (each group's lr tensor) keeps the objects: nothing is
    read or converted."""
    torch = pytest.importorskip("torch")
    from mtapply._rows import _column

    lrs = [torch.tensor([1e-3]), torch.tensor([2e-3]), 5e-4]
    column = _column("lr", lrs, 3)
    assert column.dtype == object and column[0] is lrs[0] and column[1] is lrs[1]
    assert column[2] == 5e-4
