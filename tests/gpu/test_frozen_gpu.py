"""Frozen params (requires_grad False) under flat_grads on the GPU: they do not step, their state
stays bit-identical, and they step again once unfrozen, also where a step repeats the latest
one's launches (a path only GPU plans take). The CPU cases are in tests/test_torch_flat_grads.py."""
import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mtapply.torch")
from mtapply import _torch_binding  # noqa: E402
from test_torch_flat_grads import (FROZEN_CASES, FROZEN_IDS, SCHEDULES,  # noqa: E402
                                   assert_bit_identical, check_frozen_schedule, frozen_loss,
                                   frozen_params, snapshot)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("cls,torch_cls,kw", FROZEN_CASES, ids=FROZEN_IDS)
def test_a_frozen_param_does_not_step_and_steps_again_once_unfrozen(cls, torch_cls, kw, schedule):
    check_frozen_schedule(cls, torch_cls, kw, schedule, "cuda")


def test_a_param_frozen_between_repeated_steps_is_not_stepped(monkeypatch):
    """Steps that repeat the latest one's launches see the freeze at once: the param stays as
    it was, the steps after repeat again without it, and the training is torch.optim's."""
    repeated = []
    repeat = _torch_binding.LatestStep.repeat
    monkeypatch.setattr(_torch_binding.LatestStep, "repeat",
                        lambda self, opt: repeated.append(repeat(self, opt)) or repeated[-1])
    kw = dict(lr=1e-2, weight_decay=0.1)
    params, twin_params = frozen_params("cuda"), frozen_params("cuda")
    opt = mt.AdamW(params, flat_grads=True, **kw)
    twin = torch.optim.AdamW(twin_params, foreach=False, **kw)
    frozen = range(5, 10)
    for k in range(14):
        if k == frozen.start:
            assert repeated.count(True) >= 3  # the steps before repeated the latest one
            taken, repeats = snapshot(opt, params[-1]), len(repeated)
        for ps, o in ((params, opt), (twin_params, twin)):
            ps[-1].requires_grad_(k not in frozen)
            o.zero_grad()
            frozen_loss(ps, k).backward()
            o.step()
        if k in frozen:
            assert_bit_identical(opt, params[-1], taken, f"at step {k}")
    assert repeated[repeats:].count(True) >= 3  # frozen, the steps repeat again
    assert not torch.equal(params[-1], taken[0])
    for p, q in zip(params, twin_params):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
