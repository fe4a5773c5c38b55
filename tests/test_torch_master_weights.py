"""`master_weights=True` of the mtapply.torch optimizers: fp32 masters of 16-bit params.

Each float16 or bfloat16 param keeps a float32 copy in its state ("master_param"), made at its
first step from its values; the kernel reads and updates the master and writes the param
rounded from it, and the param's other state is float32. So a bfloat16 run with masters is
the same optimizer run on float32 copies of the params: the masters hold the float32 run's
params (bit for bit on the CPU, where every op sees the same float32 inputs) and the
bfloat16 params are the masters rounded to nearest. The runs below take updates smaller than
half a bfloat16 unit in the last place per step, which a plain bfloat16 run loses (its params
stall) and the masters keep. The GPU cases compare within float32 roundings (a norm's sums may
be ordered by the vector width of the narrowest slot).
"""
import copy

import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
STEPS = 10
SHAPES = [(7, 5), (33,), (3, 4, 2), (1,)]

# (class, options): each step moves a param in [1, 2) by less than half a bfloat16 unit
# (2**-8), ten steps by more
CASES = {
    "AdamW": (mt.AdamW, dict(lr=1e-3, weight_decay=0.1)),
    "SGD-momentum": (mt.SGD, dict(lr=2e-4, momentum=0.9, weight_decay=1e-2)),
    "LARS": (mt.LARS, dict(lr=0.2, momentum=0.9, weight_decay=1e-3)),
    "LAMB": (mt.LAMB, dict(lr=1e-3, weight_decay=1e-2)),
    "Lion": (mt.Lion, dict(lr=1e-3, weight_decay=0.1)),
    "RMSprop": (mt.RMSprop, dict(lr=2e-4, momentum=0.5)),
    "NAdam": (mt.NAdam, dict(lr=1e-3)),
}


def _starts(device, shapes=SHAPES, seed=0):
    """Param values in [1, 2) that bfloat16 holds exactly (so every run starts equal)."""
    g = torch.Generator().manual_seed(seed)
    return [(1 + torch.randint(8, 120, shape, generator=g) / 128).to(device) for shape in shapes]


def _grads(shapes, step: int, device):
    """Grads of one sign in [0.5, 1.5), bfloat16 values (equal in every run)."""
    g = torch.Generator().manual_seed(1000 + step)
    return [(0.5 + torch.rand(shape, generator=g)).to(torch.bfloat16).to(device)
            for shape in shapes]


def _run(make, starts, dtypes, steps=STEPS, start_step=0, opt=None, params=None, **options):
    """Params of `dtypes` from `starts`, stepped `steps` times by `make(params, **options)`."""
    if params is None:
        params = [torch.nn.Parameter(s.to(d, copy=True)) for s, d in zip(starts, dtypes)]
    if opt is None:
        opt = make(params, **options)
    for step in range(start_step, start_step + steps):
        for p, g in zip(params, _grads([tuple(s.shape) for s in starts], step,
                                       starts[0].device)):
            p.grad = g.to(p.dtype)
        opt.step()
    return params, opt


def _same(a, b, device, what):
    if device == "cpu":
        assert torch.equal(a, b), what
    else:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7, msg=what)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(CASES))
def test_bfloat16_with_masters_steps_as_float32(case, device):
    make, options = CASES[case]
    starts = _starts(device)
    n = len(starts)
    plain, _ = _run(make, starts, [torch.bfloat16] * n, **options)
    for p, s in zip(plain, starts):  # every update under half a unit: plain bfloat16 stalls
        assert torch.equal(p.detach().float(), s), f"{case}: plain bfloat16 moved"
    reference, _ = _run(make, starts, [torch.float32] * n, **options)
    mixed, opt = _run(make, starts, [torch.bfloat16] * n, master_weights=True, **options)
    moved = False
    for i, (p, r) in enumerate(zip(mixed, reference)):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and master.shape == p.shape
        _same(master, r.detach(), device, f"{case}: master {i} is not the float32 run's param")
        assert torch.equal(p.detach(), master.to(torch.bfloat16)), f"param {i} is not rounded"
        for name, value in opt.state[p].items():  # the state is the float32 run's too
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert value.dtype == torch.float32, name
        moved |= not torch.equal(p.detach().float(), starts[i])
    assert moved, f"{case}: the masters' steps did not reach the bfloat16 params"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["AdamW", "SGD-momentum", "Lion"])
def test_float16_and_float32_params_beside_bfloat16(case, device):
    """One group of bfloat16, float16 and float32 params: the 16-bit ones step through
    masters (in a plan of their own), the float32 ones as without the option, no master."""
    make, options = CASES[case]
    starts = _starts(device)
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.float32]
    reference, _ = _run(make, starts, [torch.float32] * 4, **options)
    mixed, opt = _run(make, starts, dtypes, master_weights=True, **options)
    for i, (p, r) in enumerate(zip(mixed, reference)):
        if p.dtype == torch.float32:
            assert "master_param" not in opt.state[p]
            _same(p.detach(), r.detach(), device, f"float32 param {i}")
        else:
            _same(opt.state[p]["master_param"], r.detach(), device, f"master {i}")
            assert torch.equal(p.detach(), opt.state[p]["master_param"].to(p.dtype))


@pytest.mark.parametrize("case", ["AdamW", "LARS", "NAdam"])
def test_float32_params_make_no_master_and_step_as_without(case):
    make, options = CASES[case]
    starts = _starts("cpu")
    without, _ = _run(make, starts, [torch.float32] * 4, **options)
    with_option, opt = _run(make, starts, [torch.float32] * 4, master_weights=True, **options)
    for p, q in zip(with_option, without):
        assert "master_param" not in opt.state[p]
        assert torch.equal(p, q)
    assert "master_param" not in opt.state_dict()["state"][0]


@pytest.mark.parametrize("case", ["AdamW", "SGD-momentum", "NAdam", "LAMB"])
def test_state_dict_round_trip_keeps_the_masters(case):
    """Saved after 4 steps and loaded into a new optimizer over the bfloat16 params, the
    masters go on as in an unbroken run of 10 steps."""
    make, options = CASES[case]
    starts = _starts("cpu")
    whole, whole_opt = _run(make, starts, [torch.bfloat16] * 4, master_weights=True, **options)
    first, opt = _run(make, starts, [torch.bfloat16] * 4, steps=4, master_weights=True,
                      **options)
    saved = copy.deepcopy(opt.state_dict())
    for entry in saved["state"].values():
        assert entry["master_param"].dtype == torch.float32
    params = [torch.nn.Parameter(p.detach().clone()) for p in first]
    loaded = make(params, master_weights=True, **options)
    loaded.load_state_dict(saved)
    for k, p in enumerate(params):
        assert loaded.state[p]["master_param"].dtype == torch.float32
        assert torch.equal(loaded.state[p]["master_param"], saved["state"][k]["master_param"])
    _run(make, starts, None, steps=STEPS - 4, start_step=4, opt=loaded, params=params)
    for i, (p, q) in enumerate(zip(params, whole)):
        assert torch.equal(loaded.state[p]["master_param"], whole_opt.state[q]["master_param"]), i
        assert torch.equal(p, q), f"param {i}"


def test_checkpoint_without_masters_makes_them_from_the_params():
    """A state saved without masters (plain bfloat16 steps) loads into an optimizer with
    master_weights=True: its bfloat16 moments load as float32, and each master is made from
    its param at the next step, which then steps as float32 copies loaded alike."""
    make, options = CASES["SGD-momentum"]
    starts = _starts("cpu")
    plain, plain_opt = _run(make, starts, [torch.bfloat16] * 4, steps=3, **options)
    saved = copy.deepcopy(plain_opt.state_dict())
    params = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    opt = make(params, master_weights=True, **options)
    opt.load_state_dict(saved)
    for p in params:
        assert "master_param" not in opt.state[p]
        assert opt.state[p]["momentum_buffer"].dtype == torch.float32
    fp32 = [torch.nn.Parameter(p.detach().float()) for p in plain]
    reference = make(fp32, **options)
    reference.load_state_dict(saved)
    _run(make, starts, None, steps=STEPS, start_step=3, opt=opt, params=params)
    _run(make, starts, None, steps=STEPS, start_step=3, opt=reference, params=fp32)
    for i, (p, r) in enumerate(zip(params, fp32)):
        assert torch.equal(opt.state[p]["master_param"], r.detach()), i
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16)), i


def test_masters_loaded_without_the_option_are_dropped():
    """An optimizer without master_weights steps the bfloat16 params themselves: a loaded
    master is dropped at its param's next step, so none goes stale in later checkpoints."""
    make, options = CASES["AdamW"]
    starts = _starts("cpu")
    params, opt = _run(make, starts, [torch.bfloat16] * 4, steps=2, master_weights=True,
                       **options)
    saved = copy.deepcopy(opt.state_dict())
    plain = make(params, **options)
    plain.load_state_dict(saved)
    _run(make, starts, None, steps=1, start_step=2, opt=plain, params=params)
    assert all("master_param" not in plain.state[p] for p in params)
    assert all("master_param" not in entry for entry in plain.state_dict()["state"].values())


def test_flat_grads_and_schedule_free_eval_with_masters():
    starts = _starts("cpu")
    reference, _ = _run(mt.AdamW, starts, [torch.float32] * 4, lr=1e-3)
    mixed, opt = _run(mt.AdamW, starts, [torch.bfloat16] * 4, lr=1e-3, master_weights=True,
                      flat_grads=True)
    for p, r in zip(mixed, reference):
        assert torch.equal(opt.state[p]["master_param"], r.detach())
        assert torch.equal(p.detach(), r.detach().to(torch.bfloat16))
    # ScheduleFreeAdamW's eval()/train() move the masters, the params rounded from them
    reference, ref_opt = _run(mt.ScheduleFreeAdamW, starts, [torch.float32] * 4, lr=1e-3)
    mixed, opt = _run(mt.ScheduleFreeAdamW, starts, [torch.bfloat16] * 4, lr=1e-3,
                      master_weights=True)
    for switch in ("eval", "train"):
        getattr(ref_opt, switch)()
        getattr(opt, switch)()
        for p, r in zip(mixed, reference):
            assert torch.equal(opt.state[p]["master_param"], r.detach()), switch
            assert torch.equal(p.detach(), r.detach().to(torch.bfloat16)), switch


def test_repr_names_the_option():
    p = torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16))
    assert "master_weights=True" in repr(mt.AdamW([p], master_weights=True))
    assert "master_weights" not in repr(mt.AdamW([p]))


def _param():
    return torch.nn.Parameter(torch.ones(300, dtype=torch.bfloat16))


@pytest.mark.parametrize("make", [
    lambda ps: mt.Adam(ps, state_bits=8, master_weights=True),
    lambda ps: mt.AdamW(ps, state_bits=8, master_weights=True),
    lambda ps: mt.AdamW8bit(ps, master_weights=True),
    lambda ps: mt.Adam8bit(ps, master_weights=True),
    lambda ps: mt.SGD(ps, momentum=0.9, state_bits=8, master_weights=True),
    lambda ps: mt.LARS(ps, state_bits=8, master_weights=True),
    lambda ps: mt.Lion(ps, state_bits=8, master_weights=True),
    lambda ps: mt.RMSprop(ps, state_bits=8, master_weights=True),
    lambda ps: mt.ScheduleFreeAdamW(ps, state_bits=8, master_weights=True),
], ids=["Adam", "AdamW", "AdamW8bit", "Adam8bit", "SGD", "LARS", "Lion", "RMSprop",
        "ScheduleFreeAdamW"])
def test_eight_bit_state_refuses_masters(make):
    p = _param()
    with pytest.raises(ValueError, match=r"master_weights=True.*(state_bits=8|8-bit)"):
        make([p])
    assert torch.equal(p, torch.ones(300, dtype=torch.bfloat16))


@pytest.mark.parametrize("make", [
    lambda ps: mt.AdamW(ps, stochastic_rounding=True, master_weights=True),
    lambda ps: mt.SGD(ps, stochastic_rounding=True, master_weights=True),
    lambda ps: mt.Lion(ps, stochastic_rounding=True, master_weights=True),
    lambda ps: mt.NAdam(ps, stochastic_rounding=True, master_weights=True),
], ids=["AdamW", "SGD", "Lion", "NAdam"])
def test_stochastic_rounding_with_masters_is_refused(make):
    with pytest.raises(ValueError, match="master_weights=True with stochastic_rounding=True"):
        make([_param()])


def test_stochastic_rounding_set_later_is_refused_before_any_write():
    a, b = _param(), _param()
    opt = mt.AdamW([a], lr=1e-2, master_weights=True)
    with pytest.raises(ValueError, match="stochastic_rounding"):
        opt.add_param_group({"params": [b], "stochastic_rounding": True})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [b]})
    opt.param_groups[1]["stochastic_rounding"] = True
    for p in (a, b):
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match="param group 1: .*master_weights=True with stochastic"):
        opt.step()
    assert torch.equal(a, torch.ones_like(a)) and not opt.state


def test_sparse_grads_with_masters_are_refused_before_any_write():
    a, b = _param(), torch.nn.Parameter(torch.ones(4, 3, dtype=torch.bfloat16))
    opt = mt.SGD([a, b], lr=0.1, master_weights=True)
    a.grad = torch.ones_like(a)
    b.grad = torch.ones(4, 3, dtype=torch.bfloat16).to_sparse()
    with pytest.raises(RuntimeError, match="master_weights=True.*sparse"):
        opt.step()
    assert torch.equal(a, torch.ones_like(a)) and torch.equal(b, torch.ones_like(b))


def test_master_weights_must_be_a_bool():
    with pytest.raises(TypeError, match="master_weights"):
        mt.AdamW([_param()], master_weights="yes")
