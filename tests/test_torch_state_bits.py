"""`state_bits=8` on mtapply.torch's rule-run optimizers (bitsandbytes' `optim_bits`): the step
equals the rule's functional 8-bit step, small params keep float32 state and step as with
state_bits=32, checkpoints go round and are refused across state_bits, bad options are refused
before anything is written. `state_bits=16`: bfloat16 state slots (the ones the update writes)
on every rule-run optimizer and on Adam/AdamW, SGD, LARS and LAMB, each step as the float32
optimizer's from the same state, its state then rounded to bfloat16."""
import copy

import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402
from _torch_steps import run_steps as _run, seeded_grads as _grads, seeded_params as _params  # noqa: E402
import mtapply  # noqa: E402
from mtapply import quantization  # noqa: E402
from mtapply.rules import library  # noqa: E402



DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]





def test_8_bit_lion_steps_as_the_rules_functional_8_bit_step():
    params = _params()
    opt = mt.Lion(params, lr=1e-3, weight_decay=0.1, state_bits=8)
    twin = [p.detach().clone() for p in params]
    rule = library.lion().with_state_bits(8)
    state = rule.state(twin)
    for t in range(4):
        grads = _grads(params, t)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        rule.step(twin, grads, *state, lr=1e-3, step=t + 1, weight_decay=0.1)
    for k, (p, q) in enumerate(zip(params, twin)):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, msg=f"params[{k}]")
        entry = opt.state[p]
        torch.testing.assert_close(entry["exp_avg"], state[0][k], rtol=0, atol=0)
        torch.testing.assert_close(entry["exp_avg_absmax"], state[1][k], rtol=0, atol=0)
        quantized = p.numel() >= 4096
        assert entry["exp_avg"].dtype == (torch.uint8 if quantized else torch.float32)
        assert entry["exp_avg_absmax"].numel() == (quantization.n_blocks(p.numel()) if quantized else 0)


@pytest.mark.parametrize("make", [
    lambda ps, bits: mt.Lion(ps, lr=1e-3, weight_decay=0.1, state_bits=bits),
    lambda ps, bits: mt.Adamax(ps, lr=1e-2, state_bits=bits),
    lambda ps, bits: mt.NAdam(ps, lr=1e-2, state_bits=bits),
    lambda ps, bits: mt.Adan(ps, lr=1e-3, state_bits=bits),
    lambda ps, bits: mt.RMSprop(ps, lr=1e-3, momentum=0.9, state_bits=bits),
    lambda ps, bits: mt.Adagrad(ps, lr=1e-2, state_bits=bits),
    lambda ps, bits: mt.optimizer(library.lion(), ps, lr=1e-3, state_bits=bits),
], ids=["Lion", "Adamax", "NAdam", "Adan", "RMSprop", "Adagrad", "rule"])
def test_8_bit_state_follows_float_state_and_small_params_step_alike(make):
    eight, floats = _params(), _params()
    opt8, opt32 = make(eight, 8), make(floats, 32)
    _run(opt8, eight, 5)
    _run(opt32, floats, 5)
    for k, (p, q) in enumerate(zip(eight, floats)):
        if p.numel() < 4096:  # float32 state: the same step
            torch.testing.assert_close(p, q, rtol=0, atol=0, msg=f"params[{k}]")
            continue
        moved = (q.detach() - _params()[k].detach()).abs().mean()
        assert (p - q).abs().mean() <= 0.1 * moved, f"params[{k}] strays from float state"
        assert any(v.dtype == torch.uint8 for v in opt8.state[p].values())


def test_a_checkpoint_goes_round_and_is_refused_across_state_bits():
    params = _params()
    opt = mt.Lion(params, lr=1e-3, state_bits=8)
    _run(opt, params, 2)
    saved = copy.deepcopy(opt.state_dict())  # as saved to a file (a state_dict shares the tensors)
    resumed_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    resumed = mt.Lion(resumed_params, lr=1e-3, state_bits=8)
    resumed.load_state_dict(saved)
    _run(opt, params, 2, first_seed=10)
    _run(resumed, resumed_params, 2, first_seed=10)
    for p, q in zip(params, resumed_params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    with pytest.raises(ValueError, match="state_bits=8 to load it"):
        mt.Lion([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3).load_state_dict(saved)
    floats = mt.Lion([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3)
    _run(floats, floats.param_groups[0]["params"], 1)
    with pytest.raises(ValueError, match="state_bits=32 to load it"):
        mt.Lion([torch.nn.Parameter(p.detach().clone()) for p in params], lr=1e-3,
                state_bits=8).load_state_dict(floats.state_dict())


def test_bad_options_are_refused():
    params = _params()
    with pytest.raises(ValueError, match=r"state_bits must be 8, 16 \(bfloat16\) or 32"):
        mt.Lion(params, state_bits=4)
    with pytest.raises(ValueError, match="min_8bit_size"):
        mt.Lion(params, state_bits=8, min_8bit_size=0)
    with pytest.raises(ValueError, match=r"state_bits must be 8, 16 \(bfloat16\) or 32"):
        mt.ScheduleFreeAdamW(params, state_bits=4)  # (8: nu in 8 bits, z float)
    for adaptive in (mt.Prodigy, mt.DAdaptAdam):  # d's sums read the state
        with pytest.raises(ValueError, match=rf"{adaptive.__name__}\(state_bits=8\): its sums "
                           r"over the whole list read exp_avg, exp_avg_sq, s before the step "
                           r"updates d.*use state_bits=16"):
            adaptive(params, state_bits=8)


@pytest.mark.parametrize("device", DEVICES)
def test_a_rule_whose_sums_read_one_slot_keeps_that_one_in_float32(device):
    """A rule optimizer with state_bits=8 keeps in float32 only the slots that its whole-list
    sums read before its scalar state changes, the others in 8 bits, and steps as the rule
    does with just those in 8 bits."""
    rule = mtapply.rule("scaled_by_total", slots="param:rw grad:r a:rw b:rw",
                           hyper=dict(lr=None), scalars={"seen": 0.0},
                           totals={"size": "abs(a)"}, update="""
                               a = 0.9 * a + grad
                               seen = seen + size
                               b = 0.99 * b + grad * grad
                               param = param - lr * a / (sqrt(b) + 1e-8) / (1 + seen)
                           """)
    assert rule.summed_first == ("a",)
    params = _params(device=device)
    opt = mt.optimizer(rule, params, lr=1e-3, state_bits=8, min_8bit_size=1)
    twin = [p.detach().clone() for p in params]
    eight_bit = rule.with_state_bits(8, slots="b", threshold=1)
    state, scalars = eight_bit.state(twin), torch.tensor(rule.initial_scalars(), device=device)
    for t in range(3):
        grads = _grads(params, t)
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        eight_bit.step(twin, grads, *state, lr=1e-3, step=t + 1, scalars_out=scalars)
    for k, (p, q) in enumerate(zip(params, twin)):
        torch.testing.assert_close(p.detach(), q, rtol=0, atol=0, msg=f"params[{k}]")
        assert opt.state[p]["a"].dtype == torch.float32 and opt.state[p]["b"].dtype == torch.uint8


def test_sparse_grads_with_8_bit_adagrad_are_refused_before_anything_is_written():
    dense = torch.nn.Parameter(torch.randn(5000))
    table = torch.nn.Parameter(torch.randn(10, 4))
    opt = mt.Adagrad([{"params": [dense]}, {"params": [table]}], lr=0.1, state_bits=8)
    dense.grad = torch.randn(5000)
    table.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.randn(2, 4), (10, 4))
    before = dense.detach().clone(), table.detach().clone()
    with pytest.raises(ValueError, match="sparse grads"):
        opt.step()
    assert torch.equal(dense, before[0]) and torch.equal(table, before[1])


def test_the_functional_rule_and_the_one_call_step_agree_on_numpy():
    """`Rule.with_state_bits` on NumPy and on torch CPU tensors: the same codes."""
    import numpy as np

    rule = library.adam().with_state_bits(8, unsigned="exp_avg_sq")
    params = _params(3)
    host = [p.detach().numpy().copy() for p in params]
    tensors = [p.detach().clone() for p in params]
    grads = _grads(params, 7)
    s_host, s_torch = rule.state(host), rule.state(tensors)
    rule.step(host, [g.numpy() for g in grads], *s_host, lr=1e-2, step=1)
    rule.step(tensors, grads, *s_torch, lr=1e-2, step=1)
    for a, b in zip(host, tensors):
        np.testing.assert_array_equal(a, b.numpy())
    for column_host, column_torch in zip(s_host, s_torch):
        for a, b in zip(column_host, column_torch):
            np.testing.assert_array_equal(a, b.numpy())


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_keeps_8_bit_state_and_steps_as_the_original(how):
    import pickle

    params = _params()
    opt = mt.Lion(params, lr=1e-3, state_bits=8, min_8bit_size=1000)
    _run(opt, params, 2)
    copied = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert (copied.state_bits, copied.min_8bit_size) == (8, 1000)
    twins = copied.param_groups[0]["params"]
    _run(opt, params, 2, first_seed=20)
    _run(copied, twins, 2, first_seed=20)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert copied.state[q]["exp_avg"].dtype == opt.state[p]["exp_avg"].dtype


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_with_state_bits_8_is_the_8_bit_class(name):
    params, twins = _params(), _params()
    opt = getattr(mt, name)(params, lr=1e-2, weight_decay=0.1, state_bits=8, min_8bit_size=1000)
    eight = getattr(mt, f"{name}8bit")(twins, lr=1e-2, weight_decay=0.1, min_8bit_size=1000)
    assert type(opt) is type(eight)
    _run(opt, params, 3)
    _run(eight, twins, 3)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert opt.state[p]["exp_avg"].dtype == (torch.uint8 if p.numel() >= 1000 else torch.float32)
    assert type(getattr(mt, name)(_params(), lr=1e-2)).__name__ == name  # state_bits=32


def test_adam_state_bits_refusals_name_the_option():
    with pytest.raises(ValueError, match=r"state_bits must be 8, 16 \(bfloat16\) or 32"):
        mt.Adam(_params(), state_bits=4)
    with pytest.raises(ValueError, match="amsgrad=True with 8-bit moments"):
        mt.AdamW(_params(), amsgrad=True, state_bits=8)
    with pytest.raises(ValueError, match="for state_bits=32 use mtapply.torch.AdamW"):
        mt.AdamW8bit(_params(), state_bits=32)


def test_8_bit_state_starts_at_the_declared_first_values():
    """A slot's first value (a number, Adagrad's initial_accumulator_value) in 8 bits: the
    first step equals the float state's."""
    import mtapply

    rule = mtapply.rule("first", slots="param:rw grad:r nu:rw=0.5", hyper=dict(lr=None),
                        update="nu = nu\nparam = param - lr * nu")
    results = {}
    for bits in (32, 8):
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (16, 8192)]
        opt = mt.optimizer(rule, params, lr=0.1, state_bits=bits)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        results[bits] = [p.detach().clone() for p in params]
    for a, b in zip(results[32], results[8]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        assert torch.allclose(a, torch.full_like(a, -0.05))
    params = [torch.nn.Parameter(torch.randn(5000))]
    opt = mt.Adagrad(params, initial_accumulator_value=0.5, state_bits=8)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    entry = opt.state[params[0]]
    values = quantization.dequantize_blockwise(entry["sum"].numpy(), entry["sum_absmax"].numpy(),
                                               signed=False)
    assert abs(values - 0.5).max() < 1e-6


def test_rmsprop_options_turned_on_later_start_their_8_bit_state():
    params = _params()
    opt = mt.RMSprop(params, lr=1e-3, state_bits=8)
    _run(opt, params, 2)
    opt.param_groups[0]["centered"] = True
    opt.param_groups[0]["momentum"] = 0.9
    _run(opt, params, 2, first_seed=5)
    entry = opt.state[params[0]]
    assert entry["grad_avg"].dtype == torch.uint8 and entry["momentum_buffer"].dtype == torch.uint8


def test_a_subclass_of_adam_is_not_swapped_for_the_8_bit_class():
    class MyAdam(mt.Adam):
        pass

    with pytest.raises(ValueError, match="subclass mtapply.torch.Adam8bit"):
        MyAdam(_params(), state_bits=8)
    assert type(MyAdam(_params())) is MyAdam


SIXTEEN = {
    "Lion": lambda params, bits: mt.Lion(params, lr=1e-3, weight_decay=0.1, state_bits=bits),
    "NAdam": lambda params, bits: mt.NAdam(params, lr=1e-2, state_bits=bits),
    "Adagrad": lambda params, bits: mt.Adagrad(params, lr=1e-2, state_bits=bits),
    "Adam": lambda params, bits: mt.Adam(params, lr=1e-2, amsgrad=True, state_bits=bits),
    "AdamW": lambda params, bits: mt.AdamW(params, lr=1e-2, state_bits=bits),
    "Prodigy": lambda params, bits: mt.Prodigy(params, state_bits=bits),
    "SGD": lambda params, bits: mt.SGD(params, lr=1e-2, momentum=0.9, dampening=0.1,
                                       state_bits=bits),
    "LARS": lambda params, bits: mt.LARS(params, lr=1e-1, weight_decay=1e-3, state_bits=bits),
    "LAMB": lambda params, bits: mt.LAMB(params, lr=1e-2, state_bits=bits),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(SIXTEEN))
def test_16_bit_state_steps_as_float_state_then_rounds_it(name, device):
    """From equal state, a step of state_bits=16 moves the params as state_bits=32 does (the
    update reads the state in float32 and writes it rounded) and keeps the written slots as
    the float32 optimizer's rounded to bfloat16; read-only and scalar state keep their dtypes."""
    params, twins = _params(device=device), _params(device=device)
    sixteen, thirty_two = SIXTEEN[name](params, 16), SIXTEEN[name](twins, 32)
    _run(sixteen, params, 3)
    for p, q in zip(params, twins):
        q.data.copy_(p)
    state = copy.deepcopy(sixteen.state_dict())
    thirty_two.load_state_dict(state)  # (torch.optim's cast: the params' float32)
    written = [key for key, value in sixteen.state[params[0]].items()
               if value.dtype == torch.bfloat16]
    assert written, "no state slot is bfloat16"
    for key, value in sixteen.state[params[0]].items():
        if key not in written:
            assert value.dtype == torch.float32, key
    _run(sixteen, params, 1, first_seed=10)
    _run(thirty_two, twins, 1, first_seed=10)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key in written:
            mine, float_one = sixteen.state[p][key], thirty_two.state[q][key]
            assert mine.dtype == torch.bfloat16 and float_one.dtype == torch.float32
            # the same float32 value rounded once; a value computed a rounding apart can land
            # on the neighbouring bfloat16 (one unit in its 8 bits of mantissa)
            torch.testing.assert_close(mine.float(), float_one.to(torch.bfloat16).float(),
                                       rtol=2.0 ** -7, atol=1e-30)


@pytest.mark.parametrize("name", ["Lion", "Adam"])
def test_16_bit_state_goes_round_checkpoints_and_copies(name):
    """bfloat16 state stays bfloat16 through state_dict, deepcopy and pickle; a float32
    checkpoint loads into state_bits=16 as bfloat16, and a bfloat16 one into state_bits=32 as
    the params' dtype (torch.optim's cast)."""
    params = _params()
    opt = SIXTEEN[name](params, 16)
    _run(opt, params, 2)
    saved = opt.state_dict()
    again = SIXTEEN[name](params, 16)
    again.load_state_dict(saved)
    copied = copy.deepcopy(opt)
    for made in (again, copied):
        entry = made.state[made.param_groups[0]["params"][0]]
        assert entry["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(entry["exp_avg"], opt.state[params[0]]["exp_avg"])
    wide = SIXTEEN[name](params, 32)
    wide.load_state_dict(saved)
    assert wide.state[params[0]]["exp_avg"].dtype == torch.float32
    narrow = SIXTEEN[name](params, 16)
    narrow.load_state_dict(wide.state_dict())
    assert narrow.state[params[0]]["exp_avg"].dtype == torch.bfloat16


@pytest.mark.parametrize("make, message", [
    (lambda p: mt.SGD(p, lr=0.1, state_bits=8), r"state_bits=8 .*momentum=0"),
    (lambda p: mt.SGD(p, lr=0.1, momentum=0.9, state_bits=True), r"state_bits must be 8, 16"),
    (lambda p: mt.LARS(p, state_bits=4), r"state_bits must be 8, 16"),
    (lambda p: mt.LAMB(p, state_bits=True), r"state_bits must be 8, 16"),
], ids=["SGD-no-momentum", "SGD-bool", "LARS", "LAMB-bool"])
def test_sgd_lars_and_lamb_refuse_state_bits_they_cannot_keep(make, message):
    """8-bit SGD needs momentum (test_torch_state_bits_more.py steps it, 8-bit LARS and LAMB)."""
    with pytest.raises(ValueError, match=message):
        make(_params())


def test_16_bit_sgd_refuses_sparse_grads_before_any_group_steps():
    dense = torch.nn.Parameter(torch.ones(4))
    sparse = torch.nn.Parameter(torch.ones(3))
    opt = mt.SGD([{"params": [dense]}, {"params": [sparse]}], lr=0.1, momentum=0.9, state_bits=16)
    dense.grad = torch.ones(4)
    sparse.grad = torch.sparse_coo_tensor([[0, 2]], [1.0, 1.0], (3,))
    with pytest.raises(RuntimeError, match=r"SGD\(state_bits=16\) does not take sparse grads"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(4)) and torch.equal(sparse.detach(), torch.ones(3))


def _poisoned_grads(params, seed, device):
    """Random grads with a NaN in params[0] and an infinity in params[3], each inside a block of
    256 whose other elements are finite."""
    grads = _grads(params, seed)
    grads[0][300] = float("nan")
    grads[3][256 * 5 + 9] = float("inf")
    return [g.to(device) for g in grads]


def _eight_bit_against_float(make_8bit, make_float, device, lost):
    """Four steps of poisoned grads: the 8-bit and the float optimizer leave the same `lost`
    param elements non-finite, and every other element of every param within the 8-bit
    format's error of the float step."""
    params = _params(device=device)
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    eight, plain = make_8bit(params), make_float(twin)
    for t in range(4):
        for opt, ps in ((eight, params), (plain, twin)):
            for p, g in zip(ps, _poisoned_grads(params, t, device)):
                p.grad = g
            opt.step()
    for k, (p, q) in enumerate(zip(params, twin)):
        got, want = p.detach().cpu(), q.detach().cpu()
        torch.testing.assert_close(torch.isfinite(got), torch.isfinite(want), msg=f"params[{k}]")
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], rtol=0, atol=2e-3, msg=f"params[{k}]")
        for name, value in eight.state[p].items():
            if name.endswith("_absmax"):
                assert torch.isfinite(value).all(), f"{name} of params[{k}]"
    assert sum(int((~torch.isfinite(p.detach())).sum()) for p in params) == lost


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN's own
@pytest.mark.parametrize("device", DEVICES)
def test_a_non_finite_grad_element_makes_only_its_own_param_element_non_finite(device):
    """torch.optim.AdamW loses the one param element whose grad is NaN or infinite; 8-bit AdamW
    loses the same one, not the 256 of its block: block scales skip non-finite values."""
    _eight_bit_against_float(lambda ps: mt.AdamW8bit(ps, lr=1e-3, weight_decay=0.1),
                             lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1,
                                                          foreach=False), device, lost=2)


@pytest.mark.parametrize("device", DEVICES)
def test_8_bit_lion_loses_only_the_poisoned_elements(device):
    """Lion's sign takes an infinity to a finite step: only the NaN's element is lost."""
    _eight_bit_against_float(lambda ps: mt.Lion(ps, lr=1e-4, weight_decay=0.1, state_bits=8),
                             lambda ps: mt.Lion(ps, lr=1e-4, weight_decay=0.1), device, lost=1)
