"""Bad input: a clear error naming the argument and index, and nothing written.

Every bad tensor sits at the LAST index, so that an implementation that validated while it
updated would already have written tensors 0..N-2; each test compares every tensor before and
after the failed call.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import mtapply
from _registry import OPS, assert_close, assign, make_slots, raw_bytes, to64

N = 5
LAST = N - 1
SHAPES = [(7,), (3, 4), (1,), (300,), (4, 3)]  # the last one is not square: shape errors show
LIBS = ["numpy", "torch"]
ADAM = OPS["adam"]
HYPER = dict(lr=1e-2, step=1)


def adam_lists(lib, *, amsgrad=False, rng=None):
    rng = rng or np.random.default_rng()
    return make_slots("adam", dict(amsgrad=amsgrad, decoupled_weight_decay=False, maximize=False),
                      SHAPES, "float32", lib, rng)


def snapshot(slots: dict) -> dict:
    return {name: [_bytes_or_repr(t) for t in column]
            for name, column in slots.items() if isinstance(column, (list, tuple))}


def _bytes_or_repr(t):
    """A tensor's bytes; the object itself where they cannot be read (meta, sparse, float8:
    the bad tensor of a test, which mtapply never writes)."""
    if not _is_tensor(t):
        return repr(t)
    try:
        return raw_bytes(t)
    except (TypeError, RuntimeError, NotImplementedError):
        return id(t)


def _is_tensor(t) -> bool:
    return isinstance(t, (np.ndarray, torch.Tensor))


def call_adam(slots: dict, **hyper):
    kwargs = dict(HYPER, **hyper)
    mtapply.adam_step(slots["params"], slots["grads"], slots["exp_avgs"], slots["exp_avg_sqs"],
                      max_exp_avg_sqs=slots.get("max_exp_avg_sqs"),
                      amsgrad="max_exp_avg_sqs" in slots, **kwargs)


def assert_refused(slots: dict, error, match: str, **hyper):
    """adam_step AND adam_plan refuse `slots` with `error` matching `match`; nothing changed."""
    before = snapshot(slots)
    with pytest.raises(error, match=match):
        call_adam(slots, **hyper)
    assert snapshot(slots) == before, "a refused call modified a tensor"
    with pytest.raises(error, match=match):
        plan = mtapply.adam_plan(slots["params"], slots["grads"], slots["exp_avgs"],
                                 slots["exp_avg_sqs"], max_exp_avg_sqs=slots.get("max_exp_avg_sqs"),
                                 amsgrad="max_exp_avg_sqs" in slots)
        plan.step(**dict(HYPER, **hyper))
    assert snapshot(slots) == before, "a refused plan modified a tensor"


def expected_after_one_step(slots: dict, *, step=1, eps=1e-8) -> list:
    """Reference values of every written slot of every index after one step of HYPER."""
    arrays = {name: [to64(t) for t in column] for name, column in slots.items()}
    flags = dict(amsgrad="max_exp_avg_sqs" in slots, decoupled_weight_decay=False, maximize=False)
    hyper = dict(lr=HYPER["lr"], beta1=0.9, beta2=0.999, eps=eps, weight_decay=0.0)
    return [ADAM["reference"]({k: v[i] for k, v in arrays.items()}, flags=flags, hyper=hyper, step=step)
            for i in range(len(slots["params"]))]


def assert_matches(slots: dict, expected: list, dtype: str = "float32") -> None:
    for i, new in enumerate(expected):
        for name, values in new.items():
            assert_close(slots[name][i], values, dtype, f"{name}[{i}]")


# ---------------------------------------------------------------------------------------------
# lists


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("slot", ["grads", "exp_avgs", "exp_avg_sqs"])
def test_lists_of_different_lengths(lib, slot):
    slots = adam_lists(lib)
    slots[slot] = slots[slot][:LAST]
    assert_refused(slots, ValueError, rf"{slot} has {LAST} tensors but params has {N}")


def test_amsgrad_list_of_different_length():
    slots = adam_lists("numpy", amsgrad=True)
    slots["max_exp_avg_sqs"].append(np.zeros(3, np.float32))
    assert_refused(slots, ValueError, rf"max_exp_avg_sqs has {N + 1} tensors but params has {N}")


def test_amsgrad_without_its_state_list():
    slots = adam_lists("numpy")
    before = snapshot(slots)
    with pytest.raises(TypeError, match="max_exp_avg_sqs is required"):
        mtapply.adam_step(slots["params"], slots["grads"], slots["exp_avgs"], slots["exp_avg_sqs"],
                          amsgrad=True, **HYPER)
    with pytest.raises(TypeError, match="max_exp_avg_sqs is required"):
        mtapply.adam_plan(slots["params"], slots["grads"], slots["exp_avgs"], slots["exp_avg_sqs"],
                          amsgrad=True)
    assert snapshot(slots) == before


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("slot", ["params", "grads", "exp_avg_sqs"])
def test_single_tensor_instead_of_a_list(lib, slot):
    slots = adam_lists(lib)
    slots[slot] = slots[slot][0]
    assert_refused(slots, TypeError, rf"{slot} must be a list of tensors, got a single tensor")


@pytest.mark.parametrize("bad,match", [(None, r"grads is required by adam"),
                                       ("params", r"grads must be a list or tuple of tensors, got str"),
                                       (3.0, r"grads must be a list or tuple of tensors, got float")])
def test_not_a_list(bad, match):
    slots = adam_lists("numpy")
    slots["grads"] = bad
    assert_refused(slots, TypeError, match)


# ---------------------------------------------------------------------------------------------
# tensors


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("slot", ["grads", "exp_avgs", "exp_avg_sqs"])
def test_shape_mismatch_between_slots(lib, slot):
    slots = adam_lists(lib)
    bad = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    slots[slot][LAST] = bad if lib == "numpy" else torch.from_numpy(bad)
    assert_refused(slots, ValueError,
                   rf"{slot}\[{LAST}\] has shape \(3, 4\) but params\[{LAST}\] has \(4, 3\)")


def test_same_shape_different_layout():
    slots = adam_lists("torch")
    slots["exp_avgs"][LAST] = torch.randn(3, 4).t()  # dense, shape (4, 3), column-major
    assert_refused(slots, ValueError, rf"exp_avgs\[{LAST}\] has strides \(1, 4\) but params\[{LAST}\]")


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("slot", ["params", "grads", "exp_avg_sqs"])
@pytest.mark.parametrize("dtype", ["int32", "complex64", "uint8"])
def test_unsupported_dtype(lib, slot, dtype):
    slots = adam_lists(lib)
    bad = np.ones(SHAPES[LAST], dtype=dtype)
    slots[slot][LAST] = bad if lib == "numpy" else torch.from_numpy(bad)
    assert_refused(slots, TypeError, rf"{slot}\[{LAST}\] has dtype {dtype}.*cast it")


@pytest.mark.parametrize("slot", ["params", "exp_avg_sqs"])
@pytest.mark.parametrize("dtype,words", [("float8_e4m3fn", "float8_e4m3fn"),
                                         ("float8_e5m2", "float8_e5m2"), ("bool", "bool"),
                                         ("complex128", "complex128")])
def test_unsupported_torch_dtypes_are_named_in_words(slot, dtype, words):
    if not hasattr(torch, dtype):
        pytest.skip(f"torch {torch.__version__} has no {dtype}")
    slots = adam_lists("torch")
    slots[slot][LAST] = torch.zeros(SHAPES[LAST], dtype=getattr(torch, dtype))
    assert_refused(slots, TypeError, rf"{slot}\[{LAST}\] has dtype {words};.*cast it")


@pytest.mark.parametrize("slot", ["params", "grads"])
@pytest.mark.parametrize("make,says", [
    (lambda shape: torch.zeros(shape, device="meta"), r"Unknown device type meta"),
    (lambda shape: torch.zeros(shape).to_sparse(), r"layout other than torch\.strided"),
    (lambda shape: torch.zeros(shape, dtype=torch.complex64).conj(), r"conjugate bit"),
], ids=["meta", "sparse", "conjugate"])
def test_a_producer_refusing_dlpack_is_named_by_list_and_index(slot, make, says):
    slots = adam_lists("torch")
    slots[slot][LAST] = make(SHAPES[LAST])
    assert_refused(slots, TypeError, rf"{slot}\[{LAST}\] is a Tensor \(dtype torch\.\w+, .*"
                                     rf"cannot be read through DLPack: its producer says .*{says}")


def test_dlpack_dtype_codes_in_words():
    from mtapply._dlpack import dtype_name

    assert dtype_name(2, 32) == "float32" and dtype_name(4, 16) == "bfloat16"
    assert dtype_name(10, 8) == "float8_e4m3fn" and dtype_name(17, 4) == "float4_e2m1fn"
    assert dtype_name(5, 64) == "complex64" and dtype_name(6, 8) == "bool"
    assert dtype_name(0, 8, 4) == "int8x4" and "code 99" in dtype_name(99, 8)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_every_floating_dtype_is_accepted(dtype):
    rng = np.random.default_rng()
    slots = make_slots("adam", ADAM["flag_sets"][0], SHAPES, dtype, "torch", rng)
    expected = expected_after_one_step(slots, eps=0.1)
    call_adam(slots, eps=0.1)
    assert_matches(slots, expected, dtype)


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("slot", ["params", "grads", "exp_avgs"])
def test_strided_view_is_refused(lib, slot):
    slots = adam_lists(lib)
    base = np.random.default_rng().standard_normal((8, 3)).astype(np.float32)
    base = base if lib == "numpy" else torch.from_numpy(base)
    slots[slot][LAST] = base[::2]  # shape (4, 3), every other row
    assert_refused(slots, ValueError, rf"{slot}\[{LAST}\] .* is not dense")


@pytest.mark.parametrize("slot", ["params", "exp_avg_sqs"])
def test_self_overlapping_view_is_refused(slot):
    slots = adam_lists("numpy")
    base = np.random.default_rng().standard_normal(6).astype(np.float32)
    slots[slot][LAST] = np.lib.stride_tricks.as_strided(base, shape=(4, 3), strides=(4, 4))
    assert_refused(slots, ValueError, rf"{slot}\[{LAST}\] .* is not dense")
    slots[slot][LAST] = torch.randn(1, 3).expand(4, 3)  # stride 0: four rows on one
    assert_refused(slots, ValueError, rf"{slot}\[{LAST}\] .* is not dense")


@pytest.mark.parametrize("lib", LIBS)
@pytest.mark.parametrize("first,second", [("params", "grads"), ("exp_avgs", "exp_avg_sqs"),
                                          ("grads", "exp_avg_sqs"), ("params", "exp_avgs")])
def test_same_tensor_in_two_slots(lib, first, second):
    slots = adam_lists(lib)
    slots[second][LAST] = slots[first][LAST]
    before = snapshot(slots)
    with pytest.raises(ValueError, match="share memory") as info:
        call_adam(slots)
    assert f"{first}[{LAST}]" in str(info.value) and f"{second}[{LAST}]" in str(info.value)
    assert snapshot(slots) == before


@pytest.mark.parametrize("lib", LIBS)
def test_same_tensor_at_two_indices(lib):
    slots = adam_lists(lib)
    slots["exp_avgs"][LAST] = slots["exp_avgs"][1].reshape(SHAPES[LAST])  # a view: same memory
    before = snapshot(slots)
    with pytest.raises(ValueError, match="share memory") as info:
        call_adam(slots)
    assert "exp_avgs[1]" in str(info.value) and f"exp_avgs[{LAST}]" in str(info.value)
    assert snapshot(slots) == before


@pytest.mark.parametrize("lib", LIBS)
def test_overlapping_views_of_one_buffer(lib):
    slots = adam_lists(lib)
    buffer = np.random.default_rng().standard_normal(20).astype(np.float32)
    buffer = buffer if lib == "numpy" else torch.from_numpy(buffer)
    slots["exp_avgs"][LAST] = buffer[0:12].reshape(4, 3)
    slots["exp_avg_sqs"][LAST] = buffer[8:20].reshape(4, 3)  # elements 8..11 in both
    before = snapshot(slots)
    with pytest.raises(ValueError, match="share memory") as info:
        call_adam(slots)
    assert f"exp_avgs[{LAST}]" in str(info.value) and f"exp_avg_sqs[{LAST}]" in str(info.value)
    assert snapshot(slots) == before


def test_adjacent_views_and_shared_grads_are_allowed():
    """Disjoint views of one buffer, and one grad read for two params, are legitimate."""
    rng = np.random.default_rng()
    slots = adam_lists("numpy", rng=rng)
    buffer = (0.01 * rng.standard_normal(24) ** 2).astype(np.float32)
    slots["exp_avgs"][LAST] = buffer[0:12].reshape(4, 3)
    slots["exp_avg_sqs"][LAST] = buffer[12:24].reshape(4, 3)
    slots["grads"][0] = slots["grads"][2] = np.float32(rng.standard_normal(SHAPES[0]))
    slots["params"][2] = np.float32(rng.standard_normal(SHAPES[0]))
    slots["exp_avgs"][2] = np.zeros(SHAPES[0], np.float32)
    slots["exp_avg_sqs"][2] = np.zeros(SHAPES[0], np.float32)
    expected = expected_after_one_step(slots)
    call_adam(slots)
    assert_matches(slots, expected)


@pytest.mark.parametrize("slot", ["params", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs"])
def test_read_only_array_in_a_written_slot(slot):
    slots = adam_lists("numpy", amsgrad=True)
    slots[slot][LAST].flags.writeable = False
    assert_refused(slots, ValueError, rf"{slot}\[{LAST}\] is read-only")


def test_read_only_grads_are_fine():
    slots = adam_lists("numpy")
    for g in slots["grads"]:
        g.flags.writeable = False
    expected = expected_after_one_step(slots)
    call_adam(slots)
    assert_matches(slots, expected)


class CopyingExporter:
    """A DLPack producer that always exports a copy (and says so with IS_COPIED)."""

    def __init__(self, array):
        self.array = array

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()

    def __dlpack__(self, **kwargs):
        kwargs["copy"] = True
        return self.array.__dlpack__(**kwargs)


@pytest.mark.parametrize("slot", ["params", "grads", "exp_avgs"])
def test_copied_dlpack_export(slot):
    slots = adam_lists("numpy")
    slots[slot][LAST] = CopyingExporter(slots[slot][LAST])
    assert_refused(slots, ValueError, rf"{slot}\[{LAST}\] was exported as a copy")


@pytest.mark.parametrize("bad", [[0.1] * 12, (0.5,) * 12, 3.0, "tensor", None])
def test_object_without_dlpack(bad):
    slots = adam_lists("numpy")
    slots["grads"][LAST] = bad
    assert_refused(slots, TypeError, rf"grads\[{LAST}\] is a \w+, which does not implement DLPack")


def test_first_param_without_dlpack():
    slots = adam_lists("numpy")
    slots["params"][0] = [0.0] * 7
    assert_refused(slots, TypeError, r"params\[0\] is a list, which does not implement DLPack")


def test_jax_arrays_are_refused():
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed")
    slots = adam_lists("numpy")
    slots["exp_avgs"][LAST] = jnp.zeros(SHAPES[LAST], dtype=jnp.float32)
    assert_refused(slots, TypeError, rf"exp_avgs\[{LAST}\] is a JAX array")


# ---------------------------------------------------------------------------------------------
# hyperparameters


@pytest.mark.parametrize("hyper,error,match", ADAM["bad_hyper"],
                         ids=[repr(h) for h, _, _ in ADAM["bad_hyper"]])
def test_bad_hyperparameter(hyper, error, match):
    slots = adam_lists("numpy", amsgrad=True)
    assert_refused(slots, error, match, **hyper)


@pytest.mark.parametrize("lr", [np.array([-1.0], np.float32), torch.tensor([float("nan")])])
def test_bad_array_lr_on_cpu_skips_the_step_and_raises_the_flag(lr):
    """As on a GPU (tests/test_device_scalars.py has the rest): a device value is checked when
    the step runs, which then writes nothing."""
    slots = adam_lists("numpy")
    before = snapshot(slots)
    plan = mtapply.adam_plan(slots["params"], slots["grads"], slots["exp_avgs"],
                             slots["exp_avg_sqs"])
    plan.step(**dict(HYPER, lr=lr))
    assert snapshot(slots) == before and plan.invalid[0] == 1.0


def test_array_for_a_hyperparameter_that_must_be_a_number():
    slots = adam_lists("numpy")
    assert_refused(slots, TypeError, r"beta1 must be a Python number", beta1=np.array([0.9]))


# ---------------------------------------------------------------------------------------------
# plans keep working after an error


@pytest.mark.parametrize("lib", LIBS)
def test_plan_works_after_refused_steps(lib):
    rng = np.random.default_rng()
    slots = adam_lists(lib, rng=rng)
    plan = mtapply.adam_plan(slots["params"], slots["grads"], slots["exp_avgs"], slots["exp_avg_sqs"])
    before = snapshot(slots)
    for bad in (dict(lr=-1.0), dict(lr=float("nan")), dict(beta1=1.0), dict(step=0)):
        with pytest.raises(ValueError):
            plan.step(**dict(HYPER, **bad))
    assert snapshot(slots) == before
    expected = expected_after_one_step(slots)
    plan.step(**HYPER)
    assert_matches(slots, expected)


def test_plan_works_after_refused_rebinds():
    rng = np.random.default_rng()
    slots = adam_lists("numpy", rng=rng)
    plan = mtapply.adam_plan(slots["params"], slots["grads"], slots["exp_avgs"], slots["exp_avg_sqs"])
    good = [np.float32(rng.standard_normal(s)) for s in SHAPES]
    read_only = [g.copy() for g in good]
    read_only[LAST].flags.writeable = False
    head = good[:LAST]
    cases = [
        ("grads", head, ValueError, rf"grads has {LAST} tensors but params has {N}"),
        ("grads", head + [np.zeros((3, 4), np.float32)], ValueError,
         rf"grads\[{LAST}\] is float32 \(3, 4\)"),
        ("grads", head + [np.zeros(SHAPES[LAST], np.float64)], ValueError, rf"grads\[{LAST}\] is float64"),
        ("grads", head + [[0.0] * 12], TypeError, rf"grads\[{LAST}\] is a list"),
        ("exp_avgs", read_only, ValueError, rf"exp_avgs\[{LAST}\] is read-only"),
        ("exp_avgs", head + [CopyingExporter(good[LAST])], ValueError,
         rf"exp_avgs\[{LAST}\] was exported as a copy"),
        ("exp_avgs", head + [slots["params"][LAST]], ValueError, r"share memory"),
        ("momentum", good, ValueError, r"'momentum' is not a slot of adam"),
    ]
    before = snapshot(slots)
    for slot, tensors, error, match in cases:
        with pytest.raises(error, match=match):
            plan.rebind(slot, tensors)
    assert snapshot(slots) == before
    expected = expected_after_one_step(slots)  # still bound to the original lists
    plan.step(**HYPER)
    assert_matches(slots, expected)
    # and a good rebind takes effect
    slots["grads"] = good
    plan.rebind("grads", good)
    expected = expected_after_one_step(slots, step=2)
    plan.step(lr=HYPER["lr"], step=2)
    assert_matches(slots, expected)


def test_unknown_table_mode():
    slots = adam_lists("numpy")
    with pytest.raises(ValueError, match="table_mode='bogus'; use one of"):
        mtapply.adam_plan(slots["params"], slots["grads"], slots["exp_avgs"], slots["exp_avg_sqs"],
                          table_mode="bogus")


def test_snapshot_sees_a_one_element_change():
    """Sanity check of the harness itself: snapshot() does see a one-element change."""
    slots = adam_lists("torch")
    before = snapshot(slots)
    value = to64(slots["params"][LAST])
    value.reshape(-1)[-1] += 1.0
    assign(slots["params"][LAST], value)
    assert snapshot(slots) != before


BAD_HYPER_CASES = [(op, hyper, error, match) for op in OPS if op != "adam"
                   for hyper, error, match in OPS[op]["bad_hyper"]]


@pytest.mark.parametrize("op,hyper,error,match", BAD_HYPER_CASES,
                         ids=[f"{op}-{h!r}" for op, h, _, _ in BAD_HYPER_CASES])
def test_bad_hyperparameter_of_other_ops(op, hyper, error, match):
    """Every op refuses its out-of-range hyperparameters before writing anything."""
    flags = OPS[op]["flag_sets"][0]
    slots = make_slots(op, flags, [(4,), (0,), (9,)], "float32", "numpy", np.random.default_rng())
    before = snapshot(slots)
    good = dict(OPS[op]["hyper_sets"][0], step=1)
    with pytest.raises(error, match=match):
        OPS[op]["step"](**slots, **flags, **dict(good, **hyper))
    assert snapshot(slots) == before
