"""AMP loss scaling on every op: grads divided by grad_scale, nothing written when found_inf."""
import numpy as np
import pytest

import mtapply
from _registry import OPS, flag_id, make_slots, raw_bytes

torch = pytest.importorskip("torch")

SHAPES = [(0,), (7,), (3, 5), (1000,), (0,)]
CASES = [(op, OPS[op]["flag_sets"][-1], OPS[op]["hyper_sets"][1]) for op in OPS]
IDS = [f"{op}-{flag_id(flags)}" for op, flags, _ in CASES]


def _scaled_copy(slots: dict, scale: float) -> dict:
    """A deep copy of the slots whose grads are multiplied by `scale`."""
    out = {s: [t.clone() for t in column] for s, column in slots.items()}
    for g in out["grads"]:
        g.mul_(scale)
    return out


@pytest.mark.parametrize("as_array", [False, True], ids=["number", "array"])
@pytest.mark.parametrize("op,flags,hyper", CASES, ids=IDS)
def test_scaled_grads_give_the_unscaled_step(op, flags, hyper, as_array):
    # a power-of-two scale divides exactly, so the results must be bit-identical
    scale = 2.0**16
    slots = make_slots(op, flags, SHAPES, "float32", "torch", np.random.default_rng())
    scaled = _scaled_copy(slots, scale)
    grad_scale = torch.tensor(scale) if as_array else scale
    for step in (1, 2):
        OPS[op]["step"](**slots, **flags, **hyper, step=step)
        OPS[op]["step"](**scaled, **flags, **hyper, step=step, grad_scale=grad_scale)
    for name in slots:
        if name != "grads":
            assert [raw_bytes(t) for t in slots[name]] == [raw_bytes(t) for t in scaled[name]], name


@pytest.mark.parametrize("found_inf", [1.0, "array"], ids=["number", "array"])
@pytest.mark.parametrize("op,flags,hyper", CASES, ids=IDS)
def test_found_inf_changes_nothing(op, flags, hyper, found_inf):
    slots = make_slots(op, flags, SHAPES, "float32", "torch", np.random.default_rng())
    before = {s: [raw_bytes(t) for t in column] for s, column in slots.items()}
    flag = torch.ones(()) if found_inf == "array" else found_inf
    plan = OPS[op]["plan"](**slots, **flags)
    plan.step(**hyper, step=1, grad_scale=8.0, found_inf=flag)
    assert {s: [raw_bytes(t) for t in column] for s, column in slots.items()} == before
    plan.step(**hyper, step=1, found_inf=torch.zeros(()) if found_inf == "array" else 0.0)
    assert [raw_bytes(t) for t in slots["params"]] != before["params"]


@pytest.mark.parametrize("bad,error", [(dict(grad_scale=0.0), ValueError),
                                       (dict(grad_scale=-1.0), ValueError),
                                       (dict(grad_scale=float("nan")), ValueError),
                                       (dict(found_inf=float("nan")), ValueError),
                                       (dict(grad_scale="2"), TypeError)])
def test_bad_scaling_arguments_are_refused_before_any_write(bad, error):
    slots = make_slots("adam", OPS["adam"]["flag_sets"][0], SHAPES, "float32", "numpy",
                       np.random.default_rng())
    before = {s: [raw_bytes(t) for t in column] for s, column in slots.items()}
    with pytest.raises(error, match=next(iter(bad))):
        mtapply.adam_step(**slots, lr=1e-2, step=1, **bad)
    assert {s: [raw_bytes(t) for t in column] for s, column in slots.items()} == before
