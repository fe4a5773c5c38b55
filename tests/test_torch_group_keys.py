"""The param groups of mtapply.torch's optimizers that have a torch.optim twin hold torch.optim's
keys alone: mtapply's own options (stochastic_rounding, seed, min_8bit_size) appear only where
set to other than their defaults, so checkpoints move between the two both ways (CPU)."""
import copy

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mtapply.torch")

# name -> (torch.optim's class, mtapply's, constructor arguments both take)
TWINS = {
    "Adam": (torch.optim.Adam, mt.Adam, dict(lr=1e-2)),
    "Adam-amsgrad": (torch.optim.Adam, mt.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    "AdamW": (torch.optim.AdamW, mt.AdamW, dict(lr=1e-2)),
    "SGD": (torch.optim.SGD, mt.SGD, dict(lr=0.1)),
    "SGD-momentum": (torch.optim.SGD, mt.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "Adagrad": (torch.optim.Adagrad, mt.Adagrad, dict(lr=0.1, lr_decay=0.01)),
    "RMSprop": (torch.optim.RMSprop, mt.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "Adamax": (torch.optim.Adamax, mt.Adamax, dict(lr=1e-2, weight_decay=0.01)),
    "Adadelta": (torch.optim.Adadelta, mt.Adadelta, dict(lr=0.5)),
    "NAdam": (torch.optim.NAdam, mt.NAdam, dict(lr=1e-2, momentum_decay=0.01)),
    "RAdam": (torch.optim.RAdam, mt.RAdam, dict(lr=1e-2, decoupled_weight_decay=True)),
}
NAMES = list(TWINS)
OWN_KEYS = {"stochastic_rounding", "seed", "min_8bit_size", "state_bits", "flat_grads"}


def _params(seed=0, shapes=((6, 5), (5,), (3, 4)), dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def _clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _run(params, opt, first, last):
    for t in range(first, last):
        g = torch.Generator().manual_seed(1000 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
        opt.step()


def _group_keys(opt) -> list:
    return [set(group) for group in opt.state_dict()["param_groups"]]


def _assert_close(a, b):
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_group_keys_are_torchs(name):
    torch_cls, mt_cls, kw = TWINS[name]
    params = _params()
    ours, theirs = mt_cls(params, **kw), torch_cls(params, **kw)
    assert _group_keys(ours) == _group_keys(theirs)
    assert set(ours.defaults) == set(theirs.defaults)
    extra = {"params": _params(1, ((4,),)), "lr": 1e-3}
    ours.add_param_group(dict(extra))
    theirs.add_param_group(dict(extra, params=_clones(extra["params"])))
    assert _group_keys(ours) == _group_keys(theirs)
    _run([p for g in ours.param_groups for p in g["params"]], ours, 0, 2)  # still steps
    assert _group_keys(ours) == _group_keys(theirs)


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_of_mtapply_continues_in_torch(name):
    torch_cls, mt_cls, kw = TWINS[name]
    params = _params()
    ours = mt_cls(params, **kw)
    _run(params, ours, 0, 3)
    saved = copy.deepcopy(ours.state_dict())
    moved = _clones(params)
    theirs = torch_cls(moved, **kw)
    theirs.load_state_dict(saved)
    assert _group_keys(theirs) == _group_keys(torch_cls(_params(), **kw))
    _run(params, ours, 3, 6)
    _run(moved, theirs, 3, 6)
    _assert_close(params, moved)


@pytest.mark.parametrize("name", NAMES)
def test_a_checkpoint_of_torch_continues_in_mtapply(name):
    torch_cls, mt_cls, kw = TWINS[name]
    params = _params()
    theirs = torch_cls(params, **kw)
    _run(params, theirs, 0, 3)
    saved = copy.deepcopy(theirs.state_dict())
    moved = _clones(params)
    ours = mt_cls(moved, **kw)
    ours.load_state_dict(saved)
    assert _group_keys(ours) == _group_keys(theirs)
    _run(params, theirs, 3, 6)
    _run(moved, ours, 3, 6)
    _assert_close(params, moved)
    assert _group_keys(ours) == _group_keys(theirs)


# name -> (mtapply's class, the torch.optim class a checkpoint passes through, options)
NON_DEFAULT = {
    "AdamW-stochastic": (mt.AdamW, torch.optim.AdamW, dict(stochastic_rounding=True, seed=3)),
    "SGD-seed": (mt.SGD, torch.optim.SGD, dict(momentum=0.9, seed=5)),
    "NAdam-stochastic": (mt.NAdam, torch.optim.NAdam, dict(stochastic_rounding=True)),
    "AdamW-8bit": (mt.AdamW, torch.optim.AdamW, dict(state_bits=8, min_8bit_size=8, seed=7)),
    "Adamax-8bit": (mt.Adamax, torch.optim.Adamax,
                    dict(state_bits=8, stochastic_rounding=True, seed=2)),
}


def _own(group) -> dict:
    return {k: v for k, v in group.items() if k in OWN_KEYS}


@pytest.mark.parametrize("name", list(NON_DEFAULT))
def test_options_set_otherwise_are_kept_and_restored(name):
    """A non-default own option stays in the groups (and in an added one); a checkpoint carries
    it through torch.optim and back into an optimizer made with the defaults."""
    mt_cls, torch_cls, options = NON_DEFAULT[name]
    own = {k: v for k, v in options.items() if k in OWN_KEYS - {"state_bits"}}
    bits = {k: v for k, v in options.items() if k == "state_bits"}  # not a group option
    params, added = _params(dtype=torch.bfloat16), _params(1, ((4,),), torch.bfloat16)
    ours = mt_cls(params, lr=1e-2, **options)
    ours.add_param_group({"params": added})
    assert [_own(g) for g in ours.param_groups] == [own, own]
    _run(params + added, ours, 0, 2)
    saved = copy.deepcopy(ours.state_dict())
    theirs = torch_cls([{"params": _clones(params)}, {"params": _clones(added)}], lr=1e-2)
    theirs.load_state_dict({"state": {}, "param_groups": saved["param_groups"]})
    back = theirs.state_dict()["param_groups"]  # torch.optim keeps keys it does not read
    again = mt_cls(_clones(params), lr=1e-2, **bits)
    again.add_param_group({"params": _clones(added)})
    again.load_state_dict({"state": saved["state"], "param_groups": back})
    assert [_own(g) for g in again.param_groups] == [own, own]
    _run(list(again.param_groups[0]["params"]) + list(again.param_groups[1]["params"]),
         again, 2, 3)


def test_a_loaded_torch_checkpoint_takes_the_optimizers_own_options():
    """A torch.optim checkpoint says nothing of mtapply's options: those the optimizer was made
    with apply (torch.optim's __setstate__ gives a later flag its default the same way)."""
    params = _params()
    theirs = torch.optim.AdamW(params, lr=1e-2)
    _run(params, theirs, 0, 2)
    ours = mt.AdamW(_clones(params), lr=1e-2, stochastic_rounding=True, seed=4)
    ours.load_state_dict(theirs.state_dict())
    assert ours.param_groups[0]["stochastic_rounding"] is True
    assert ours.param_groups[0]["seed"] == 4


def _bfloat16_params():
    g = torch.Generator().manual_seed(3)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(torch.bfloat16))
            for s in ((64,), (8, 8))]


def _stochastic_steps(groups_of) -> list:
    params = _bfloat16_params()
    opt = mt.AdamW(groups_of(params), lr=1e-2, stochastic_rounding=True)
    for _ in range(3):
        for p in params:
            p.grad = torch.full(p.shape, 1e-3, dtype=torch.bfloat16)
        opt.step()
    return params


def test_a_seed_given_as_its_default_steps_as_the_default():
    """A group that names seed=0 steps (and merges with the others) as one that leaves it out."""
    implicit = _stochastic_steps(lambda ps: [{"params": ps[:1]}, {"params": ps[1:]}])
    explicit = _stochastic_steps(lambda ps: [{"params": ps[:1]}, {"params": ps[1:], "seed": 0}])
    for p, q in zip(implicit, explicit):
        assert torch.equal(p, q)


def test_own_keys_are_absent_by_default():
    for name in NAMES:
        torch_cls, mt_cls, kw = TWINS[name]
        for keys in _group_keys(mt_cls(_params(), **kw)):
            assert not keys & OWN_KEYS, name
    for cls in (mt.Adam8bit, mt.AdamW8bit):
        for keys in _group_keys(cls(_params())):
            assert not keys & OWN_KEYS, cls.__name__
