"""`state_bits=8` on SGD (momentum, nesterov), LARS, LAMB and ScheduleFreeAdamW (as on the
rule-run optimizers of test_torch_state_bits.py): the step equals the library rule's functional
8-bit step bit for bit, tracks the float32 optimizer within the 8-bit format's error, small
params keep float32 state, checkpoints go round and are refused across state_bits; SGD without
momentum and bad values are refused at construction."""
import copy
import pickle

import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402
from _torch_steps import run_steps as _run, seeded_grads as _grads, seeded_params as _params  # noqa: E402
from mtapply import quantization  # noqa: E402
from mtapply.rules import library  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]





def _lars_groups(params):
    """params[2] excluded (a plain momentum step): per-tensor values of the rule."""
    return [{"params": params[:2] + params[3:]}, {"params": params[2:3], "exclude": True}]


def _sf_hyper(opt):
    group = opt.param_groups[0]  # the values its latest step took
    return dict(lr=group["_lr"], ck=group["_ck"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


# name -> (make(params, bits), the functional 8-bit rule, hyper(opt) of the rule's step)
CASES = {
    "SGD": (lambda ps, bits, **kw: mt.SGD(ps, lr=0.05, momentum=0.9, dampening=0.1,
                                          weight_decay=0.01, state_bits=bits, **kw),
            lambda: library.sgd(True, False).with_state_bits(8),
            lambda opt: dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "SGD-nesterov": (lambda ps, bits, **kw: mt.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                   maximize=True, state_bits=bits, **kw),
                     lambda: library.sgd(True, True, True).with_state_bits(8),
                     lambda opt: dict(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=0.0)),
    "LARS": (lambda ps, bits, **kw: mt.LARS(_lars_groups(ps), lr=0.1, weight_decay=1e-3,
                                            trust_coefficient=0.01, state_bits=bits, **kw),
             lambda: library.lars().with_state_bits(8),
             lambda opt: dict(lr=0.1, momentum=0.9, weight_decay=1e-3, trust_coefficient=0.01,
                              eps=0.0, adapt=(1.0, 1.0, 0.0, 1.0),
                              decay_on=(1.0, 1.0, 0.0, 1.0))),
    "LAMB": (lambda ps, bits, **kw: mt.LAMB(ps, lr=1e-2, weight_decay=0.01, max_grad_norm=0.0,
                                            state_bits=bits, **kw),
             lambda: library.lamb().with_state_bits(8, unsigned="exp_avg_sq"),
             lambda opt: dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)),
    "ScheduleFreeAdamW": (lambda ps, bits, **kw: mt.ScheduleFreeAdamW(
                              ps, lr=1e-2, weight_decay=0.01, warmup_steps=3, state_bits=bits, **kw),
                          lambda: library.schedule_free_adamw().with_state_bits(
                              8, slots="nu", unsigned="nu"),
                          _sf_hyper),
}

EIGHT_BIT = {"SGD": "momentum_buffer", "SGD-nesterov": "momentum_buffer",
             "LARS": "momentum_buffer", "LAMB": "exp_avg", "ScheduleFreeAdamW": "nu"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_8_bit_step_equals_the_rules_functional_8_bit_step(name, device):
    make, eight_bit_rule, hyper = CASES[name]
    params = _params(device=device)
    opt = make(params, 8)
    twin = [p.detach().clone() for p in params]
    rule = eight_bit_rule()
    state = rule.state(twin)
    for t in range(4):
        grads = _grads(params, t)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        rule.step(twin, grads, *state, step=t + 1, **hyper(opt))
    columns = dict(zip(rule.slots[2:], state))
    slot = EIGHT_BIT[name]
    for k, (p, q) in enumerate(zip(params, twin)):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, msg=f"params[{k}]")
        entry = opt.state[p]
        for key, column in columns.items():
            torch.testing.assert_close(entry[key], column[k], rtol=0, atol=0,
                                       msg=f"{key} of params[{k}]")
        quantized = p.numel() >= 4096
        assert entry[slot].dtype == (torch.uint8 if quantized else torch.float32)
        assert entry[f"{slot}_absmax"].numel() == (
            quantization.n_blocks(p.numel()) if quantized else 0)
    if name == "ScheduleFreeAdamW":
        assert all(opt.state[p]["z"].dtype == torch.float32 for p in params)  # z stays float


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_8_bit_state_tracks_float_state_and_small_params_step_alike(name, device):
    make = CASES[name][0]
    eight, floats = _params(device=device), _params(device=device)
    opt8, opt32 = make(eight, 8), make(floats, 32)
    _run(opt8, eight, 10)
    _run(opt32, floats, 10)
    start = _params(device=device)
    for k, (p, q) in enumerate(zip(eight, floats)):
        if p.numel() < 4096:  # float32 state: the float32 step
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=f"params[{k}]")
            continue
        moved = (q.detach() - start[k].detach()).abs().mean()
        assert moved > 0
        assert (p - q).abs().mean() <= 0.05 * moved, f"params[{k}] strays from float state"
        assert (p - q).abs().max() <= 0.05 * (q.detach() - start[k].detach()).abs().max()


@pytest.mark.parametrize("name", sorted(CASES))
def test_params_under_min_8bit_size_keep_float32_state(name):
    make = CASES[name][0]
    params = _params()
    opt = make(params, 8, min_8bit_size=5000)
    _run(opt, params, 2)
    slot = EIGHT_BIT[name]
    for p in params:
        entry = opt.state[p]
        if p.numel() >= 5000:
            assert entry[slot].dtype == torch.uint8 and entry[slot].shape == p.shape
            assert entry[f"{slot}_absmax"].numel() == quantization.n_blocks(p.numel())
        else:
            assert entry[slot].dtype == torch.float32 and entry[f"{slot}_absmax"].numel() == 0
    assert opt.min_8bit_size == 5000


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_checkpoint_goes_round_and_is_refused_across_state_bits(name, device):
    make = CASES[name][0]
    params = _params(device=device)
    opt = make(params, 8)
    _run(opt, params, 2)
    saved = copy.deepcopy(opt.state_dict())  # as saved to a file
    slot = EIGHT_BIT[name]
    assert {slot, f"{slot}_absmax"} <= set(saved["state"][0])
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = make(resumed_params, 8)
    resumed.load_state_dict(saved)
    _run(opt, params, 2, first_seed=10)
    _run(resumed, resumed_params, 2, first_seed=10)
    for p, q in zip(params, resumed_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert opt.state[p][slot].dtype == resumed.state[q][slot].dtype
    for bits in (32, 16):
        with pytest.raises(ValueError, match="state_bits=8 to load it"):
            make([torch.nn.Parameter(p.detach().clone()) for p in params], bits).load_state_dict(saved)
        float_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
        floats = make(float_params, bits)
        _run(floats, float_params, 1)
        with pytest.raises(ValueError, match="state_bits=32 to load it"):
            make([torch.nn.Parameter(p.detach().clone()) for p in params],
                 8).load_state_dict(floats.state_dict())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name", ["SGD", "LARS", "LAMB", "ScheduleFreeAdamW"])
def test_a_copy_keeps_8_bit_state_and_steps_as_the_original(name, how):
    params = _params()
    opt = CASES[name][0](params, 8, min_8bit_size=1000)
    _run(opt, params, 2)
    copied = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert (copied.state_bits, copied.min_8bit_size) == (8, 1000)
    twins = [p for group in copied.param_groups for p in group["params"]]
    originals = [p for group in opt.param_groups for p in group["params"]]
    _run(opt, originals, 2, first_seed=20)
    _run(copied, twins, 2, first_seed=20)
    slot = EIGHT_BIT[name]
    for p, q in zip(originals, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert copied.state[q][slot].dtype == opt.state[p][slot].dtype


def test_schedule_free_adamw_keeps_z_float_and_refuses_an_8_bit_z():
    params = _params()
    opt = mt.ScheduleFreeAdamW(params, lr=1e-2, state_bits=8)
    _run(opt, params, 2)
    assert all(opt.state[p]["z"].dtype == torch.float32 for p in params)
    y = [p.detach().clone() for p in params]
    opt.eval()  # x from y and the float z, and back
    opt.train()
    for p, q in zip(params, y):
        torch.testing.assert_close(p.detach(), q, rtol=1e-6, atol=1e-6)
    saved = copy.deepcopy(opt.state_dict())
    z, scales = quantization.quantize_blockwise(saved["state"][0]["z"].numpy(), signed=True)
    saved["state"][0]["z"], saved["state"][0]["z_absmax"] = torch.from_numpy(z), torch.from_numpy(scales)
    with pytest.raises(ValueError, match="holds 'z' in 8 bits"):
        mt.ScheduleFreeAdamW(_params(), lr=1e-2, state_bits=8).load_state_dict(saved)
    sixteen = mt.ScheduleFreeAdamW(params, lr=1e-2, state_bits=16)
    _run(sixteen, params, 1)
    entry = sixteen.state[params[0]]
    assert entry["z"].dtype == torch.float32 and entry["nu"].dtype == torch.bfloat16


@pytest.mark.parametrize("make", [
    lambda ps, bits: mt.SGD(ps, lr=0.1, momentum=0.9, state_bits=bits),
    lambda ps, bits: mt.LARS(ps, state_bits=bits),
    lambda ps, bits: mt.LAMB(ps, state_bits=bits),
    lambda ps, bits: mt.ScheduleFreeAdamW(ps, state_bits=bits),
], ids=["SGD", "LARS", "LAMB", "ScheduleFreeAdamW"])
@pytest.mark.parametrize("bits", [4, 0, True, "8", 8.5])
def test_bad_state_bits_are_refused_naming_the_argument(make, bits):
    with pytest.raises(ValueError, match=r"state_bits must be 8, 16 \(bfloat16\) or 32"):
        make(_params(), bits)


def test_construction_refusals():
    params = _params()
    for make in (lambda **kw: mt.SGD(params, lr=0.1, momentum=0.9, state_bits=8, **kw),
                 lambda **kw: mt.LARS(params, state_bits=8, **kw),
                 lambda **kw: mt.LAMB(params, state_bits=8, **kw),
                 lambda **kw: mt.ScheduleFreeAdamW(params, state_bits=8, **kw)):
        for size in (0, -1, 1.5):
            with pytest.raises(ValueError, match="min_8bit_size"):
                make(min_8bit_size=size)
    with pytest.raises(ValueError, match=r"state_bits=8 .*momentum=0"):
        mt.SGD(params, lr=0.1, state_bits=8)


@pytest.mark.parametrize("device", DEVICES)
def test_8_bit_lamb_clips_by_the_global_norm_and_tracks_float_lamb(device):
    """max_grad_norm > 0: the global grad norm, computed on the device, reaches the 8-bit rule
    as it reaches the float op; the trust ratios' norms are sums over the moments as the
    update reads them."""
    eight, floats = _params(device=device), _params(device=device)
    opt8 = mt.LAMB(eight, lr=1e-2, max_grad_norm=0.5, state_bits=8)
    opt32 = mt.LAMB(floats, lr=1e-2, max_grad_norm=0.5)
    _run(opt8, eight, 10)
    _run(opt32, floats, 10)
    start = _params(device=device)
    for k, (p, q) in enumerate(zip(eight, floats)):
        moved = (q.detach() - start[k].detach()).abs().mean()
        assert moved > 0
        if p.numel() < 4096:  # float32 state, though the other params' codes move the norm
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"params[{k}]")
            continue
        assert (p - q).abs().mean() <= 0.05 * moved, f"params[{k}] strays from float state"


def test_8_bit_sgd_refuses_a_group_without_momentum_before_anything_is_written():
    first, second = torch.nn.Parameter(torch.ones(5000)), torch.nn.Parameter(torch.ones(3))
    opt = mt.SGD([first], lr=0.1, momentum=0.9, state_bits=8)
    opt.add_param_group({"params": [second], "momentum": 0.0})
    first.grad, second.grad = torch.ones(5000), torch.ones(3)
    with pytest.raises(ValueError, match=r"param group 1: SGD with state_bits=8 .*momentum=0"):
        opt.step()
    assert torch.equal(first.detach(), torch.ones(5000)) and not opt.state


def test_8_bit_sgd_refuses_sparse_grads_before_any_group_steps():
    dense = torch.nn.Parameter(torch.ones(5000))
    sparse = torch.nn.Parameter(torch.ones(3))
    opt = mt.SGD([{"params": [dense]}, {"params": [sparse]}], lr=0.1, momentum=0.9, state_bits=8)
    dense.grad = torch.ones(5000)
    sparse.grad = torch.sparse_coo_tensor([[0, 2]], [1.0, 1.0], (3,))
    with pytest.raises(RuntimeError, match=r"SGD\(state_bits=8\) does not take sparse grads"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(5000)) and torch.equal(sparse.detach(), torch.ones(3))


def test_a_param_that_joins_later_takes_its_first_8_bit_momentum_step():
    """SGD's first momentum step (the buffer set to the grad) for a param that steps after the
    others have: its buffer is then the grad in 8 bits, as the rule's step 1 leaves it."""
    early, late = torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(6000))
    opt = mt.SGD([early, late], lr=0.1, momentum=0.9, state_bits=8)
    early.grad = torch.randn(5000)
    opt.step()
    assert late not in opt.state
    twin = late.detach().clone()
    grad = torch.randn(6000)
    early.grad, late.grad = torch.randn(5000), grad
    opt.step()
    rule = library.sgd(True).with_state_bits(8)
    state = rule.state([twin])
    rule.step([twin], [grad], *state, lr=0.1, momentum=0.9, step=1)
    torch.testing.assert_close(late.detach(), twin, rtol=0, atol=0)
    torch.testing.assert_close(opt.state[late]["momentum_buffer"], state[0][0], rtol=0, atol=0)


def test_state_of_a_slot_that_starts_at_the_param_is_a_copy():
    """`with_state_bits(...).state(params)`: a float slot declared `=param` (a small param's z)
    is its own tensor, not a view of the param's memory."""
    params = [torch.randn(10), torch.randn(5000)]
    rule = library.schedule_free_adamw().with_state_bits(8, slots="nu", unsigned="nu")
    z = rule.state(params)[0]
    for p, made in zip(params, z):
        assert torch.equal(p, made) and made.data_ptr() != p.data_ptr()
