"""mtapply.torch optimizers' state, param groups and copies as torch.optim keeps them: list
options edited in place, list edits of param_groups, state_dict/load_state_dict (hooks, older
layouts, the saved `step`, incomplete or foreign states), a state replaced or edited by hand,
deepcopy and pickle, sparse grads, `differentiable`, params' version counters, and a resume
through torch.distributed.checkpoint. Every optimizer, flat_grads off and on (CPU)."""
import copy
import pickle
from collections import defaultdict

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mtapply.torch")
from mtapply.rules import library  # noqa: E402
from mtapply.torch_galore import GaLoreAdamW  # noqa: E402

# name -> a maker of the optimizer over params (groups), with flat_grads (None: not taken)
OPTIMIZERS = {
    "Adam": lambda ps, **kw: mt.Adam(ps, lr=1e-2, **kw),
    "AdamW": lambda ps, **kw: mt.AdamW(ps, lr=1e-2, amsgrad=True, **kw),
    "Adam8bit": lambda ps, **kw: mt.Adam8bit(ps, lr=1e-2, min_8bit_size=4, **kw),
    "AdamW8bit": lambda ps, **kw: mt.AdamW8bit(ps, lr=1e-2, min_8bit_size=4, **kw),
    "SGD": lambda ps, **kw: mt.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, **kw),
    "SGD-plain": lambda ps, **kw: mt.SGD(ps, lr=0.1, **kw),
    "LARS": lambda ps, **kw: mt.LARS(ps, lr=0.1, **kw),
    "LAMB": lambda ps, **kw: mt.LAMB(ps, lr=1e-2, **kw),
    "Adagrad": lambda ps, **kw: mt.Adagrad(ps, lr=0.1, lr_decay=0.01, **kw),
    "RMSprop": lambda ps, **kw: mt.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True, **kw),
    "Lion": lambda ps, **kw: mt.Lion(ps, lr=1e-3, weight_decay=0.1, **kw),
    "Adan": lambda ps, **kw: mt.Adan(ps, lr=1e-2, **kw),
    "ScheduleFreeAdamW": lambda ps, **kw: mt.ScheduleFreeAdamW(ps, lr=1e-2, warmup_steps=2, **kw),
    "RuleOptimizer": lambda ps, **kw: mt.optimizer(library.adam(), ps, lr=1e-2, **kw),
    "Adamax": lambda ps, **kw: mt.Adamax(ps, lr=1e-2, weight_decay=0.01, **kw),
    "Adadelta": lambda ps, **kw: mt.Adadelta(ps, lr=0.5, **kw),
    "RAdam": lambda ps, **kw: mt.RAdam(ps, lr=1e-2, decoupled_weight_decay=True, **kw),
    "NAdam": lambda ps, **kw: mt.NAdam(ps, lr=1e-2, momentum_decay=0.01, **kw),
    "GaLoreAdamW": lambda ps: GaLoreAdamW(_ranked(ps), lr=1e-2),
}
NAMES = list(OPTIMIZERS)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
TAKES_FLAT = [n for n in NAMES if n != "GaLoreAdamW"]
CASES = [(n, False) for n in NAMES] + [(n, True) for n in TAKES_FLAT]
CASE_IDS = [f"{n}-{'flat' if f else 'plain'}" for n, f in CASES]
COUNTING_CASES = CASES
# the state tensor each optimizer keeps (besides `step`), to remove or replace
KEPT = {"Adam": "exp_avg", "AdamW": "exp_avg_sq", "Adam8bit": "exp_avg", "AdamW8bit": "exp_avg",
        "SGD": None, "SGD-plain": None, "LARS": "momentum_buffer", "LAMB": "exp_avg",
        "Adagrad": "sum", "RMSprop": "square_avg", "Lion": "exp_avg", "Adan": "n",
        "ScheduleFreeAdamW": "z", "RuleOptimizer": "exp_avg", "GaLoreAdamW": "exp_avg",
        "Adamax": "exp_inf", "Adadelta": "acc_delta", "RAdam": "exp_avg_sq", "NAdam": "exp_avg"}


def _ranked(params):
    """GaLore's groups: 2-D params projected (rank 2), the rest plain AdamW."""
    params = list(params)
    if params and isinstance(params[0], dict):
        return [dict(g, rank=2, update_proj_gap=3) for g in params]
    return [{"params": params, "rank": 2, "update_proj_gap": 3}]


def _make(name, params, flat=False):
    return OPTIMIZERS[name](params) if name == "GaLoreAdamW" else OPTIMIZERS[name](
        params, flat_grads=flat)


def _params(seed=0, shapes=((6, 5), (5,), (3, 4), (2,)), device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


def _clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]



def _set_grads(params, t, opt=None):
    """Step t's grads: written into the flat views where the optimizer keeps them."""
    g = torch.Generator().manual_seed(1000 + t)
    if opt is not None:
        opt.zero_grad()
    for p in params:
        grad = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.copy_(grad)


def _run(params, opt, first, last):
    for t in range(first, last):
        _set_grads(params, t, opt)
        opt.step()


def _assert_same(a, b, exact=False):
    for p, q in zip(a, b):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def _groups(params, merged, **options):
    """Two groups (one plan where `merged`: equal compile options), or one."""
    if merged:
        return [dict(params=params[:2], **options), dict(params=params[2:], **options)]
    return [dict(params=params, **options)]


# -- param groups: list options, list edits -----------------------------------------------------

BETAS = {"Adam": [0.9, 0.999], "AdamW": [0.9, 0.999], "Adam8bit": [0.9, 0.999],
         "AdamW8bit": [0.9, 0.999], "LAMB": [0.9, 0.999], "Lion": [0.9, 0.99],
         "Adan": [0.98, 0.92, 0.99], "ScheduleFreeAdamW": [0.9, 0.999], "GaLoreAdamW": [0.9, 0.999]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("merged", [False, True], ids=["one-group", "merged-groups"])
@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
@pytest.mark.parametrize("name", list(BETAS))
def test_a_list_option_edited_in_place_is_followed(name, flat, merged, device):
    """group["betas"][0] = x between steps acts as setting a new betas list does."""
    if flat and name == "GaLoreAdamW":
        pytest.skip("GaLoreAdamW takes no flat_grads")
    base = _params(device=device)
    runs = {}
    for how in ("in place", "set", "unchanged"):
        params = _clones(base)
        opt = _make(name, _groups(params, merged, betas=list(BETAS[name])), flat)
        _run(params, opt, 0, 3)
        for group in opt.param_groups:
            if how == "in place":
                group["betas"][0] = 0.5
            elif how == "set":
                group["betas"] = [0.5] + list(BETAS[name][1:])
        _run(params, opt, 3, 6)
        runs[how] = params
    _assert_same(runs["in place"], runs["set"], exact=True)
    assert not all(torch.equal(p, q) for p, q in zip(runs["in place"], runs["unchanged"]))


@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
def test_a_list_option_shared_by_groups_is_edited_for_all_as_torch_does(flat):
    base = _params()
    results = []
    for cls, extra in ((torch.optim.Adam, dict(foreach=False)), (mt.Adam, dict(flat_grads=flat))):
        params = _clones(base)
        betas = [0.9, 0.999]  # one list in both groups, as a default put there by setdefault
        opt = cls([{"params": params[:2], "betas": betas}, {"params": params[2:], "betas": betas}],
                  lr=1e-2, **extra)
        _run(params, opt, 0, 2)
        opt.param_groups[0]["betas"][0] = 0.3
        assert opt.param_groups[1]["betas"][0] == 0.3
        _run(params, opt, 2, 5)
        results.append(params)
    _assert_same(*results)


LIST_EDITS = {
    "reverse": lambda groups, new: groups.reverse(),
    "append": lambda groups, new: groups.append(new),
    "insert": lambda groups, new: groups.insert(0, new),
    "extend": lambda groups, new: groups.extend([new]),
    "+=": lambda groups, new: groups.__iadd__([new]),
    "slice": lambda groups, new: groups.__setitem__(slice(1, 2), [groups[1], new]),
}


@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
@pytest.mark.parametrize("edit", list(LIST_EDITS))
@pytest.mark.parametrize("pair", [(torch.optim.SGD, mt.SGD, dict(lr=0.1, momentum=0.9)),
                                  (torch.optim.Adam, mt.Adam, dict(lr=1e-2))],
                         ids=["SGD", "Adam"])
def test_param_groups_edited_as_a_list_step_as_torchs(pair, edit, flat):
    torch_cls, mt_cls, kw = pair
    base, extra = _params(), _params(seed=7, shapes=((4, 3),))
    results = []
    for cls, options in ((torch_cls, dict(foreach=False)), (mt_cls, dict(flat_grads=flat))):
        params, more = _clones(base), _clones(extra)
        opt = cls([{"params": params[:2]}, {"params": params[2:], "lr": kw["lr"] / 2}], **kw,
                  **options)
        _run(params, opt, 0, 2)
        new = dict(opt.param_groups[0], params=more, lr=kw["lr"] / 3)
        LIST_EDITS[edit](opt.param_groups, new)
        for t in range(2, 5):
            _set_grads(params + more, t, opt)
            opt.step()
        results.append((params + more, opt.state_dict()))
    _assert_same(results[0][0], results[1][0])
    assert ([g["params"] for g in results[0][1]["param_groups"]]
            == [g["params"] for g in results[1][1]["param_groups"]])


@pytest.mark.parametrize("flat", [False, True], ids=["plain", "flat"])
def test_groups_extended_by_themselves_save_like_torch_and_refuse_to_step(flat):
    params = _params()
    opt = mt.Adam([{"params": params[:2]}, {"params": params[2:]}], lr=1e-2, flat_grads=flat)
    _run(params, opt, 0, 2)
    before = opt.state_dict()
    opt.param_groups.extend(opt.param_groups)  # terminates; each group listed twice
    opt.param_groups += []
    saved = opt.state_dict()
    assert len(saved["param_groups"]) == 4
    assert saved["param_groups"][2]["params"] == before["param_groups"][0]["params"]
    kept = [p.detach().clone() for p in params]
    _set_grads(params, 2, opt)
    with pytest.raises(ValueError, match="param 0 of param group 2 is also param 0 of param "
                                         "group 0: a param belongs to one group"):
        opt.step()
    _assert_same(params, kept, exact=True)
    del opt.param_groups[2:]
    opt.step()  # one group each again: steps
    assert not torch.equal(params[0], kept[0])


# -- state_dict and load_state_dict -----------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_state_dict_hooks_run_as_torchs(name):
    params = _params()
    opt = _make(name, params)
    _run(params, opt, 0, 2)
    seen = []

    def pre(o):
        o.state["note"] = 1  # a non-dict entry: saved as it is

    def post(o, saved):
        seen.append(saved)
        assert saved["state"]["note"] == 1
        for p, entry in zip(params, [v for v in saved["state"].values() if v != 1]):
            assert entry is not o.state[p]  # the saved form, not the live dicts
            step = entry.get("step")
            if isinstance(step, torch.Tensor):
                assert step is not o.state[p]["step"]
        return dict(saved, by_post_hook=True)

    opt.register_state_dict_pre_hook(pre)
    opt.register_state_dict_post_hook(post)
    saved = opt.state_dict()
    assert saved["by_post_hook"] and seen and saved["state"]["note"] == 1

    twin_params = _clones(params)
    twin = _make(name, twin_params)
    calls = []

    def load_pre(o, state_dict):
        calls.append("pre")
        changed = copy.deepcopy(state_dict)
        changed["param_groups"][0]["lr"] = 0.125
        return changed

    def load_post(o):
        calls.append("post")
        assert o.param_groups[0]["lr"] == 0.125 and o.state["note"] == 1
        assert set(o.state[twin_params[0]]) == set(opt.state[params[0]])

    twin.register_load_state_dict_pre_hook(load_pre)
    twin.register_load_state_dict_post_hook(load_post)
    twin.load_state_dict(saved)
    assert calls == ["pre", "post"]
    opt.param_groups[0]["lr"] = 0.125
    _run(params, opt, 2, 4)
    _run(twin_params, twin, 2, 4)
    _assert_same(params, twin_params)


TORCH_PAIRS = {"Adam": (torch.optim.Adam, mt.Adam, dict(lr=1e-2)),
               "AdamW": (torch.optim.AdamW, mt.AdamW, dict(lr=1e-2)),
               "SGD": (torch.optim.SGD, mt.SGD, dict(lr=0.1, momentum=0.9)),
               "Adagrad": (torch.optim.Adagrad, mt.Adagrad, dict(lr=0.1)),
               "RMSprop": (torch.optim.RMSprop, mt.RMSprop, dict(lr=1e-2)),
               "Adamax": (torch.optim.Adamax, mt.Adamax, dict(lr=1e-2)),
               "Adadelta": (torch.optim.Adadelta, mt.Adadelta, dict(lr=0.5)),
               "RAdam": (torch.optim.RAdam, mt.RAdam, dict(lr=1e-2)),
               "NAdam": (torch.optim.NAdam, mt.NAdam, dict(lr=1e-2))}
LATER_FLAGS = ("maximize", "foreach", "capturable", "differentiable", "fused", "amsgrad",
               "nesterov", "centered", "decoupled_weight_decay")


@pytest.mark.parametrize("name", list(TORCH_PAIRS))
def test_an_older_state_dict_takes_torchs_defaults(name):
    torch_cls, mt_cls, kw = TORCH_PAIRS[name]
    groups = {}
    for cls in (torch_cls, mt_cls):
        params = _params()
        opt = cls(params, **kw)
        _run(params, opt, 0, 2)
        old = copy.deepcopy(opt.state_dict())
        for flag in LATER_FLAGS:
            old["param_groups"][0].pop(flag, None)
        opt.load_state_dict(old)
        _run(params, opt, 2, 3)
        groups[cls] = opt.param_groups[0]
    for key, value in groups[torch_cls].items():
        if key != "params":
            assert groups[mt_cls][key] == value, key


def test_a_loaded_group_missing_a_required_option_is_refused():
    params = _params()
    opt = mt.optimizer(library.adam(), [{"params": params, "lr": 1e-2}])  # no default lr
    _run(params, opt, 0, 1)
    saved = copy.deepcopy(opt.state_dict())
    del saved["param_groups"][0]["lr"]
    with pytest.raises(ValueError, match="lacks 'lr'"):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("default_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name,options", [
    ("Adam", {}), ("Adam", dict(fused=True)), ("AdamW", dict(foreach=True)),
    ("Adagrad", {}), ("Adagrad", dict(fused=True)), ("RMSprop", {})])
def test_the_saved_step_is_what_torch_saves(name, options, default_dtype):
    torch_cls, mt_cls, kw = TORCH_PAIRS[name]
    old = torch.get_default_dtype()
    torch.set_default_dtype(default_dtype)
    try:
        steps = []
        for cls in (torch_cls, mt_cls):
            params = [torch.nn.Parameter(torch.randn(3, dtype=torch.float32))]
            opt = cls(params, **kw, **options)
            _run(params, opt, 0, 3)
            steps.append(opt.state_dict()["state"][0]["step"])
    finally:
        torch.set_default_dtype(old)
    assert steps[1].dtype == steps[0].dtype and steps[1].device == steps[0].device
    assert steps[1].item() == steps[0].item() == 3


@pytest.mark.parametrize("name", TAKES_FLAT)
def test_each_param_saves_its_own_step(name):
    """Params of one plan share one device counter; each saved step is its own tensor."""
    params = _params()
    opt = _make(name, params)
    _run(params, opt, 0, 3)
    params[1].grad = None
    opt.step()
    saved = opt.state_dict()["state"]
    steps = [entry["step"] for entry in saved.values() if "step" in entry]
    assert len({id(s) for s in steps}) == len(steps)
    if steps:
        assert [float(s) for s in steps] == [4.0, 3.0, 4.0, 4.0]


def test_no_empty_state_entries_where_torch_keeps_none():
    params = _params()
    opt = mt.SGD(params, lr=0.1)  # without momentum torch.optim.SGD keeps no state
    _run(params, opt, 0, 2)
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {}
    sf = mt.ScheduleFreeAdamW(params, lr=1e-2)
    sf.eval()
    sf.train()
    assert len(sf.state) == 0


def _required_removed(name, saved):
    entry = saved["state"][0]
    del entry[KEPT[name]]


@pytest.mark.parametrize("name", [n for n in NAMES if KEPT[n] and n != "LARS"])  # (LARS: then empty)
def test_an_incomplete_state_is_refused_before_anything_changes(name):
    params = _params()
    opt = _make(name, params)
    _run(params, opt, 0, 2)
    saved = copy.deepcopy(opt.state_dict())
    _required_removed(name, saved)
    twin_params = _clones(params)
    twin = _make(name, twin_params)
    _run(twin_params, twin, 0, 1)
    before = copy.deepcopy(twin.state_dict())
    with pytest.raises(KeyError, match=f"the loaded state of param 0 has no '{KEPT[name]}'"):
        twin.load_state_dict(saved)
    torch.testing.assert_close(twin.state_dict(), before)
    # the same state put in by hand is refused by the step, before any write
    kept = [p.detach().clone() for p in params]
    del opt.state[params[0]][KEPT[name]]
    _set_grads(params, 2, opt)
    with pytest.raises(KeyError, match=f"param 0.* has no '{KEPT[name]}'"):
        opt.step()
    _assert_same(params, kept, exact=True)


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("SGD")])  # (no step)
@pytest.mark.parametrize("bad", [2.5, -1.0, float("nan")])
def test_a_step_count_that_is_not_a_whole_number_is_refused_before_anything_changes(name, bad):
    params = _params()
    opt = _make(name, params)
    _run(params, opt, 0, 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["state"][0]["step"] = torch.tensor(bad)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"the loaded state of param 0 holds 'step' .*whole"):
        opt.load_state_dict(saved)
    torch.testing.assert_close(opt.state_dict(), before, equal_nan=True)
    # the same count put in by hand is refused by the step, before any write (on the CPU the
    # kernels' own check would skip that param alone, and its count would stay as it is)
    kept = [p.detach().clone() for p in params]
    opt.state[params[0]]["step"] = torch.tensor(bad)
    _set_grads(params, 2, opt)
    with pytest.raises(ValueError, match=r"param 0.* holds 'step' .*whole number >= 0"):
        opt.step()
    _assert_same(params, kept, exact=True)


@pytest.mark.parametrize("source,target", [("Adam8bit", "Adam"), ("AdamW8bit", "AdamW"),
                                           ("Adam", "Adam8bit"), ("AdamW", "AdamW8bit")])
def test_8bit_and_float_moments_are_not_mixed(source, target):
    params = _params()
    opt = _make(source, params)
    _run(params, opt, 0, 2)
    saved = copy.deepcopy(opt.state_dict())
    other = _make(target, _clones(params))
    match = "holds 8-bit moments" if "8bit" in source else "holds float moments"
    with pytest.raises(ValueError, match=f"the loaded state of param 0 {match}"):
        other.load_state_dict(saved)
    assert len(other.state) == 0
    other_params = list(other.param_groups[0]["params"])
    other.state[other_params[0]] = dict(saved["state"][0])  # by hand: refused by the step
    _set_grads(other_params, 0, other)
    with pytest.raises(ValueError, match=match):
        other.step()


def test_8bit_states_load_with_their_own_dtypes_bit_for_bit():
    params = [torch.nn.Parameter(torch.randn(300, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))]  # float32 moments
    opt = mt.AdamW8bit(params, lr=1e-2, min_8bit_size=256)
    _run(params, opt, 0, 3)
    saved = copy.deepcopy(opt.state_dict())
    twin = mt.AdamW8bit(_clones(params), lr=1e-2, min_8bit_size=256)
    twin.load_state_dict(saved)
    for p, entry in zip(twin.param_groups[0]["params"], saved["state"].values()):
        for key, value in entry.items():
            if key != "step":
                loaded = twin.state[p][key]
                assert loaded.dtype == value.dtype and torch.equal(loaded, value), key


def test_a_string_in_the_state_loads_as_a_string():
    params = _params()
    opt = mt.Adam(params, lr=1e-2)
    _run(params, opt, 0, 1)
    opt.state[params[0]]["note"] = "kept"
    twin = mt.Adam(_clones(params), lr=1e-2)
    twin.load_state_dict(opt.state_dict())
    assert twin.state[twin.param_groups[0]["params"][0]]["note"] == "kept"


STATE_EDITS = {
    "state replaced": lambda opt, ps: setattr(opt, "state", defaultdict(dict)),
    "state cleared": lambda opt, ps: opt.state.clear(),
    "entry emptied": lambda opt, ps: opt.state.__setitem__(ps[0], {}),
    "entry deleted": lambda opt, ps: opt.state.__delitem__(ps[2]),
    "entry popped": lambda opt, ps: opt.state.pop(ps[2]),
    "tensor replaced": None,  # the optimizer's KEPT tensor of param 0, a new one
    "step replaced": lambda opt, ps: opt.state[ps[0]].__setitem__("step", torch.tensor(7.0)),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("edit", list(STATE_EDITS))
@pytest.mark.parametrize("name,flat", CASES, ids=CASE_IDS)
def test_a_state_edited_by_hand_is_followed_and_saved(name, flat, edit, device):
    """After any edit of optimizer.state, the optimizer steps as a fresh one loaded with its
    state_dict does: the plans bound to the old tensors are bound again."""
    if edit == "step replaced" and name in ("SGD", "SGD-plain", "LARS"):
        pytest.skip("keeps no step")
    if edit in ("entry deleted", "entry popped") and name == "SGD-plain":
        pytest.skip("keeps no state")
    params = _params(device=device)
    opt = _make(name, params, flat)
    _run(params, opt, 0, 3)
    if edit == "tensor replaced":
        if not KEPT[name]:
            pytest.skip("keeps no state tensor")
        old = opt.state[params[0]][KEPT[name]]
        opt.state[params[0]][KEPT[name]] = old.clone() * (0.5 if old.is_floating_point() else 1)
    else:
        STATE_EDITS[edit](opt, params)
    twin_params = _clones(params)
    twin = _make(name, twin_params, flat)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))
    for t in range(3, 6):
        for ps, o in ((params, opt), (twin_params, twin)):
            _set_grads(ps, t, o)
            o.step()
        _assert_same(params, twin_params)
    torch.testing.assert_close(opt.state_dict(), twin.state_dict())


# -- copies ---------------------------------------------------------------------------------------

def _public(obj) -> set:
    return {k for k in obj.__dict__ if not k.startswith("_")}


def _state_addresses(opt) -> set:
    return {v.data_ptr() for entry in opt.state.values() if isinstance(entry, dict)
            for v in entry.values() if isinstance(v, torch.Tensor) and v.numel()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("name,flat", COUNTING_CASES, ids=CASE_IDS)
def test_a_copy_steps_as_the_original_and_shares_nothing_with_it(name, flat, how, device):
    params = _params(device=device)
    opt = _make(name, params, flat)
    _run(params, opt, 0, 3)
    copied = copy.deepcopy(opt) if how == "deepcopy" else pickle.loads(pickle.dumps(opt))
    assert _public(copied) == _public(opt)
    if name == "RuleOptimizer":
        assert copied.rule.slots == opt.rule.slots
    assert not _state_addresses(copied) & _state_addresses(opt)
    twin_params = [p for g in copied.param_groups for p in g["params"]]
    for t in range(3, 6):  # the copy first: a shared counter or plan would move the original
        for ps, o in ((twin_params, copied), (params, opt)):
            _set_grads(ps, t, o)
            o.step()
        _assert_same(params, twin_params, exact=True)
    torch.testing.assert_close(copied.state_dict(), opt.state_dict())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,flat", CASES, ids=CASE_IDS)
def test_a_loaded_optimizer_never_steps_with_the_state_it_replaced(name, flat, device):
    """load_state_dict drops every plan bound to the old state (freed once the load is done)."""
    params = _params(device=device)
    opt = _make(name, params, flat)
    _run(params, opt, 0, 3)
    saved = copy.deepcopy(opt.state_dict())
    _run(params, opt, 3, 5)  # the live state moves on, then the saved one comes back
    reference_params = _clones(params)
    reference = _make(name, reference_params, flat)
    reference.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(saved)
    for t in range(5, 8):
        for ps, o in ((params, opt), (reference_params, reference)):
            _set_grads(ps, t, o)
            o.step()
    _assert_same(params, reference_params, exact=True)


# -- sparse grads, differentiable ---------------------------------------------------------------

SPARSE = [(torch.optim.SGD, mt.SGD, dict(lr=0.1)),
          (torch.optim.SGD, mt.SGD, dict(lr=0.1, momentum=0.9, dampening=0.1)),
          (torch.optim.SGD, mt.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
          (torch.optim.Adagrad, mt.Adagrad, dict(lr=0.1)),
          (torch.optim.Adagrad, mt.Adagrad, dict(lr=0.1, lr_decay=0.05, eps=1e-6,
                                                 initial_accumulator_value=0.2, maximize=True))]


def _sparse_grad(rows, width, t):
    g = torch.Generator().manual_seed(t)
    index = torch.tensor([[t % rows, (3 * t + 1) % rows, t % rows]])  # uncoalesced
    return torch.sparse_coo_tensor(index, torch.randn(3, width, generator=g), (rows, width))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("merged", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("torch_cls,mt_cls,kw", SPARSE,
                         ids=[f"{m.__name__}-{i}" for i, (_, m, _) in enumerate(SPARSE)])
def test_sparse_grads_step_as_torchs(torch_cls, mt_cls, kw, merged, device):
    """An embedding's sparse grads beside dense ones: torch.optim's update for the sparse
    params, the fused one for the rest; a param whose grads turn dense joins the fused step."""
    base = _params(shapes=((10, 3), (4,), (3, 2)), device=device)
    results = []
    for cls, extra in ((torch_cls, dict(foreach=False)), (mt_cls, {})):
        params = _clones(base)
        opt = cls(_groups(params, merged, lr=kw["lr"] / 2) if merged else params,
                  **kw, **extra)
        for t in range(6):
            _set_grads(params[1:], t)
            dense_now = t == 4 and "momentum" not in kw  # (torch's momentum cannot mix them)
            grad = _sparse_grad(10, 3, t).to(device)
            params[0].grad = grad.to_dense() if dense_now else grad
            opt.step()
        results.append(params)
    _assert_same(*results)


def test_sparse_grads_refuse_grad_scaler_scales_clearly():
    params = _params(shapes=((10, 3),))
    opt = mt.SGD(params, lr=0.1)
    params[0].grad = _sparse_grad(10, 3, 0)
    opt.grad_scale, opt.found_inf = torch.ones(()), torch.zeros(())
    kept = params[0].detach().clone()
    with pytest.raises(RuntimeError, match="sparse grads do not take GradScaler"):
        opt.step()
    assert torch.equal(params[0], kept)


@pytest.mark.parametrize("cls", [mt.Adam, mt.AdamW, mt.SGD, mt.Adagrad, mt.RMSprop])
def test_differentiable_is_refused_everywhere_it_is_taken(cls):
    params = _params()
    with pytest.raises(ValueError, match="differentiable=True: .* not differentiable"):
        cls(params, lr=0.1, differentiable=True)
    with pytest.raises(ValueError, match="differentiable=True"):
        cls([{"params": params[:2]}, {"params": params[2:], "differentiable": True}], lr=0.1)
    opt = cls(params[:2], lr=0.1)
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.add_param_group({"params": params[2:], "differentiable": True})
    assert len(opt.param_groups) == 1
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["differentiable"] = True
    with pytest.raises(ValueError, match="differentiable=True"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["differentiable"] is False


# -- autograd's version counters ------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,flat", CASES, ids=CASE_IDS)
def test_a_step_moves_the_version_of_the_params_it_writes(name, flat, device):
    params = _params(device=device)
    opt = _make(name, params, flat)
    for t in range(4):  # the first steps, then steps repeating the latest (flat_grads)
        _set_grads(params, t, opt)
        if not flat:
            params[3].grad = None  # not stepped: its version stays, as with torch.optim
        versions = [p._version for p in params]
        opt.step()
        assert all(p._version > v for p, v in zip(params[:3], versions))
        if not flat:
            assert params[3]._version == versions[3]
    saved_for_backward = (params[0] * params[0]).sum()  # saves params[0]
    _set_grads(params, 4, opt)
    opt.step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        saved_for_backward.backward()


# -- torch.distributed.checkpoint --------------------------------------------------------------

@pytest.mark.parametrize("name,flat", [
    (n, f) for n in ("AdamW", "SGD", "Lion", "ScheduleFreeAdamW") for f in (False, True)])
def test_a_distributed_checkpoint_resume_keeps_the_state(name, flat, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         get_optimizer_state_dict,
                                                         set_model_state_dict,
                                                         set_optimizer_state_dict)

    def model_and_optimizer():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
        return model, _make(name, model.parameters(), flat)

    def train(model, opt, first, last):
        for t in range(first, last):
            opt.zero_grad()
            model(torch.randn(5, 4, generator=torch.Generator().manual_seed(t))).square().sum().backward()
            opt.step()

    model, opt = model_and_optimizer()
    train(model, opt, 0, 3)
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=str(tmp_path))
    resumed, resumed_opt = model_and_optimizer()
    loaded = {"model": get_model_state_dict(resumed),
              "optim": get_optimizer_state_dict(resumed, resumed_opt)}
    dcp.load(loaded, checkpoint_id=str(tmp_path))
    set_model_state_dict(resumed, loaded["model"])
    set_optimizer_state_dict(resumed, resumed_opt, loaded["optim"])
    torch.testing.assert_close(resumed_opt.state_dict()["state"], opt.state_dict()["state"])
    train(model, opt, 3, 6)
    train(resumed, resumed_opt, 3, 6)
    _assert_same(list(model.parameters()), list(resumed.parameters()), exact=True)


def test_lamb_global_norm_plan_is_keyed_by_the_grads_owners_not_their_ids(monkeypatch):
    """A freed owner's id may come back on a tensor of another size: the norm's plan is found
    by the owners themselves (here every id is made equal, as a reused one would be)."""
    from mtapply import torch as mtorch

    monkeypatch.setattr(mtorch, "id", lambda obj: 0, raising=False)
    norm = mtorch._GlobalNorm()
    a = torch.ones(100)
    norm.compute([a], [a], None)
    assert norm.on(a.device).item() == 10.0
    norm.clear()
    b = torch.full((4,), 2.0)
    norm.compute([b], [b], None)
    assert norm.on(b.device).item() == 4.0
