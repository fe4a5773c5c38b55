"""mtapply.torch.Muon with state_bits=16 and 8: each state slot stored as asked (bfloat16; 8-bit
codes with float32 scales, float32 below min_8bit_size), steps that follow the float32
optimizer, checkpoints that resume exactly and keep their storage through torch's load, and
state saved at other state_bits refused before anything changes."""
import copy
import pickle

import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402
from mtapply import quantization  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
LR = 0.02
# Muon: a matrix of 8,192 elements (8-bit) and one of 256 (kept float32 at 8 bits); AdamW:
# an embedding of 5,120 (8-bit) and a bias
MATRICES, OTHERS = [(64, 128), (16, 16)], [(80, 64), (300,)]


def _model(device, seed=1):
    g = torch.Generator().manual_seed(seed)
    make = lambda s: torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(device))
    return [make(s) for s in MATRICES], [make(s) for s in OTHERS]


def _optimizer(matrices, others, **storage):
    return mt.Muon([{"params": matrices}, {"params": others, "use_muon": False, "lr": 1e-3}],
                   lr=LR, weight_decay=0.01, **storage)


def _train(opt, params, steps, first=0):
    for t in range(first, first + steps):
        g = torch.Generator().manual_seed(100 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.device)
        opt.step()


def _relative_gap(ours, reference, start):
    """|ours - reference| over how far the reference moved from `start`."""
    moved = torch.cat([(r.detach() - s).flatten() for r, s in zip(reference, start)]).norm()
    gap = torch.cat([(o.detach() - r.detach()).flatten() for o, r in zip(ours, reference)]).norm()
    return float(gap / moved)


@pytest.mark.parametrize("device", DEVICES)
def test_each_slot_is_stored_as_state_bits_asks(device):
    matrices, others = _model(device)
    opt = _optimizer(matrices, others, state_bits=8)
    _train(opt, matrices + others, 1)
    for p, names in [(m, ("momentum_buffer",)) for m in matrices] + \
                    [(o, ("exp_avg", "exp_avg_sq")) for o in others]:
        for name in names:
            values, scales = opt.state[p][name], opt.state[p][f"{name}_absmax"]
            assert values.shape == p.shape and values.device == p.device
            if p.numel() >= opt.min_8bit_size:
                assert values.dtype == torch.uint8 and scales.dtype == torch.float32
                assert scales.numel() == quantization.n_blocks(p.numel())
            else:
                assert values.dtype == torch.float32 and scales.numel() == 0

    matrices, others = _model(device)
    opt = _optimizer(matrices, others, state_bits=16)
    _train(opt, matrices + others, 1)
    kept = {name: value.dtype for p in matrices + others
            for name, value in opt.state[p].items() if name != "step"}
    assert kept == {"momentum_buffer": torch.bfloat16, "exp_avg": torch.bfloat16,
                    "exp_avg_sq": torch.bfloat16}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits, tolerance", [(16, 0.02), (8, 0.05)])
def test_steps_follow_the_float_optimizer(bits, tolerance, device):
    """Over 20 steps the params stay within a few percent (of how far they moved) of the
    float32 optimizer's; the momentum's rounding is all that differs."""
    start = [p.detach().clone() for p in sum(_model(device), [])]
    reference, ours = _model(device), _model(device)
    _train(_optimizer(*reference), sum(reference, []), 20)
    _train(_optimizer(*ours, state_bits=bits), sum(ours, []), 20)
    gap = _relative_gap(sum(ours, []), sum(reference, []), start)
    assert 0 < gap < tolerance, gap


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits", [16, 8])
def test_a_checkpoint_resumes_exactly_with_its_storage(bits, device):
    straight = _model(device)
    opt = _optimizer(*straight, state_bits=bits)
    _train(opt, sum(straight, []), 3)
    saved = copy.deepcopy(opt.state_dict())
    values = [p.detach().clone() for p in sum(straight, [])]
    _train(opt, sum(straight, []), 2, first=3)

    resumed = _model(device)
    with torch.no_grad():
        for p, v in zip(sum(resumed, []), values):
            p.copy_(v)
    again = _optimizer(*resumed, state_bits=bits)
    again.load_state_dict(saved)
    for p, q in zip(sum(straight, []), sum(resumed, [])):
        assert {k: v.dtype for k, v in again.state[q].items()} == \
            {k: v.dtype for k, v in opt.state[p].items()}
    _train(again, sum(resumed, []), 2, first=3)
    for p, q in zip(sum(straight, []), sum(resumed, [])):
        assert torch.equal(p, q)


def test_float_state_loads_into_bfloat16_state():
    matrices, others = _model("cpu")
    full = _optimizer(matrices, others)
    _train(full, matrices + others, 2)
    half = _optimizer(*_model("cpu"), state_bits=16)
    half.load_state_dict(full.state_dict())
    for p in half.state:
        for name, value in half.state[p].items():
            assert value.dtype == (torch.float32 if name == "step" else torch.bfloat16), name


def test_state_saved_at_other_state_bits_is_refused_before_anything_changes():
    matrices, others = _model("cpu")
    eight = _optimizer(matrices, others, state_bits=8)
    _train(eight, matrices + others, 1)
    full = _optimizer(*_model("cpu"))
    with pytest.raises(ValueError, match=r"param group 0: param 0 holds 'momentum_buffer_absmax'.*"
                                         r"state_bits=8"):
        full.load_state_dict(eight.state_dict())
    assert not full.state

    full_matrices, full_others = _model("cpu")
    full = _optimizer(full_matrices, full_others)
    _train(full, full_matrices + full_others, 1)
    eight = _optimizer(*_model("cpu"), state_bits=8)
    with pytest.raises(ValueError, match=r"param group 0: param 0 holds 'momentum_buffer' without "
                                         r"'momentum_buffer_absmax'"):
        eight.load_state_dict(full.state_dict())
    assert not eight.state


def test_a_bad_state_edited_in_is_refused_before_any_group_moves():
    matrices, others = _model("cpu")
    opt = _optimizer(matrices, others, state_bits=8)
    _train(opt, matrices + others, 1)
    before = [p.detach().clone() for p in matrices + others]
    opt.state[others[0]]["exp_avg_absmax"] = torch.zeros(3)  # the AdamW group's, after Muon's
    with pytest.raises(ValueError, match=r"param group 1: param 0's state 'exp_avg' has 3 "
                                         r"torch.float32 scales.* take 20 contiguous"):
        _train(opt, matrices + others, 1, first=1)
    assert all(torch.equal(p, b) for p, b in zip(matrices + others, before))
    opt.state[others[0]]["exp_avg_absmax"] = torch.zeros(20)
    opt.state[matrices[0]]["momentum_buffer"] = torch.zeros(128, 64, dtype=torch.uint8).t()
    with pytest.raises(ValueError, match=r"param group 0: param 0's state 'momentum_buffer' is "
                                         r"\(64, 128\) torch.uint8 .* strides \(1, 64\)"):
        _train(opt, matrices + others, 1, first=1)
    assert all(torch.equal(p, b) for p, b in zip(matrices + others, before))


@pytest.mark.parametrize("storage, message", [
    (dict(state_bits=4), "state_bits must be 8, 16"), (dict(state_bits=True), "state_bits"),
    (dict(min_8bit_size=0), "min_8bit_size"), (dict(min_8bit_size=2.5), "min_8bit_size")])
def test_bad_storage_arguments_are_refused(storage, message):
    with pytest.raises(ValueError, match=message):
        _optimizer(*_model("cpu"), **storage)


def test_copies_keep_their_storage():
    opt = _optimizer(*_model("cpu"), state_bits=8, min_8bit_size=1024)
    for copied in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert (copied.state_bits, copied.min_8bit_size) == (8, 1024)
    assert (_optimizer(*_model("cpu")).state_bits, opt.state_bits) == (32, 8)
