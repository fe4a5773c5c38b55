"""User-written rules on the GPU: the generated kernel against the rule's float64 definition
and its NumPy path, over lists with a big tensor (first and last elements checked), device
scalars, bf16 params with fp32 master weights, and a CUDA graph replay."""
import copy
import sys
from pathlib import Path

import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import mtapply.torch as mt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the CPU tests' rules
from test_rule_scalars import EMA  # noqa: E402
from test_rules import ADAGRAD, EVERYTHING, LAMB, LARS, LION, ROUNDED, ROUNDING, TIE  # noqa: E402

SHAPES = [(10,), (3, 4), (0,), (1,), (257,), (1 << 20 | 3,)]


def _lists(n, seed, positive=(), device="cuda", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        column = [torch.randn(s, generator=g) for s in SHAPES]
        out.append([(x.abs() if k in positive else x).to(device, dtype) for x in column])
    return out


def _host(lists):
    """NumPy copies (bf16, which NumPy lacks, as its float32 values)."""
    return [[_numpy(x) for x in column] for column in lists]


def _numpy(x):
    x = x.detach()
    return (x.float() if x.dtype == torch.bfloat16 else x).cpu().numpy().copy()


# `everything` squares its slot `a` each step and adds sign(grad): a value near zero is the
# difference of terms near 1, so a last-bit difference in exp/log/pow grows to about 1e-5
# absolute over five steps
@pytest.mark.parametrize("name,definition,hyper,positive,atol", [
    ("lion", LION, dict(lr=0.01, weight_decay=0.1), (), 2e-6),
    ("adagrad", ADAGRAD, dict(lr=0.1, lr_decay=0.01, weight_decay=0.05), (2,), 2e-6),
    ("everything", EVERYTHING, dict(lr=0.1), (3,), 5e-5),
    ("lars", LARS, dict(lr=0.5, weight_decay=0.01, trust_coefficient=0.02, eps=1e-6), (), 2e-6),
    ("lamb", LAMB, dict(lr=1e-2), (3,), 2e-6),
    ("ema", EMA, dict(lr=0.25), (), 2e-6),  # state only: the params stay as they are
])
def test_gpu_steps_match_the_cpu_path(name, definition, hyper, positive, atol):
    rule = mtapply.rule(name, **definition)
    lists = _lists(len(rule.slots), 0, positive)
    host = _host(lists)
    for step in range(1, 6):
        rule.step(*lists, step=step, **hyper)
        rule.step(*host, step=step, **hyper)
    torch.cuda.synchronize()
    for k, slot in enumerate(rule.slots):
        for i, (got, want) in enumerate(zip(lists[k], host[k])):
            got = got.cpu().numpy()
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=atol,
                                       err_msg=f"{name}: {slot}[{i}]")
            if got.size:
                for end in (0, -1):
                    assert got.reshape(-1)[end] == pytest.approx(want.reshape(-1)[end],
                                                                 rel=2e-5, abs=atol)


def test_device_scalars_and_a_cuda_graph():
    lion = mtapply.rule("lion", **LION)
    lists = _lists(3, 1)
    twin = [[x.clone() for x in column] for column in lists]
    lr = torch.full((1,), 0.01, device="cuda")
    plan = lion.plan(*lists)
    plan.step(lr=lr)  # warm up: compile and upload outside the capture
    lion.step(*twin, lr=0.01)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.step(lr=lr)
    for value in (0.02, 0.005):
        lr.fill_(value)
        graph.replay()
        lion.step(*twin, lr=value)
    torch.cuda.synchronize()
    for got, want in zip(lists[0] + lists[2], twin[0] + twin[2]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_bf16_params_with_fp32_master_weights():
    lion = mtapply.rule("lion", **LION)
    params, grads, exp_avgs = _lists(3, 2)
    masters = [p.clone() for p in params]
    reference = [p.double() for p in params]
    ref_m = [m.double() for m in exp_avgs]
    params16 = [p.to(torch.bfloat16) for p in params]
    for _ in range(3):
        lion.step(params16, grads, exp_avgs, lr=0.01, master_params=masters)
        for i, g in enumerate(grads):
            c = 0.9 * ref_m[i] + 0.1 * g.double()
            reference[i] = reference[i] - 0.01 * torch.sign(c)
            ref_m[i] = 0.99 * ref_m[i] + 0.01 * g.double()
    torch.cuda.synchronize()
    for p16, master, want in zip(params16, masters, reference):
        torch.testing.assert_close(master.double(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(p16, master.to(torch.bfloat16), rtol=0, atol=0)


JAX_TWINS = {  # name -> (our constructor name, its arguments, optax's twin)
    "lion": ("lion", dict(learning_rate=1e-3, weight_decay=0.1),
             lambda optax: optax.lion(1e-3, weight_decay=0.1)),
    "adan": ("adan", dict(learning_rate=1e-3, weight_decay=0.01),
             lambda optax: optax.adan(1e-3, weight_decay=0.01)),
    "rmsprop": ("rmsprop", dict(learning_rate=1e-3, centered=True, momentum=0.9),
                lambda optax: optax.rmsprop(1e-3, centered=True, momentum=0.9)),
    "schedule_free": ("schedule_free_adamw", dict(learning_rate=1e-2, warmup_steps=3),
                      lambda optax: optax.contrib.schedule_free_adamw(1e-2, warmup_steps=3)),
    "adamax": ("adamax", dict(learning_rate=1e-3), lambda optax: optax.adamax(1e-3)),
    "adadelta": ("adadelta", dict(learning_rate=0.5, weight_decay=0.01),
                 lambda optax: optax.adadelta(0.5, weight_decay=0.01)),
    "radam": ("radam", dict(learning_rate=1e-3, b2=0.99), lambda optax: optax.radam(1e-3, b2=0.99)),
}


@pytest.mark.parametrize("name", list(JAX_TWINS))
@pytest.mark.parametrize("form", ["transformation", "fused"])
def test_jax_steps_through_the_ffi_call_follow_optax(form, name):
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import mtapply.optax as mtx

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("jax has no GPU backend here")
    rng = np.random.default_rng(3)
    tree = lambda: {f"p{i}": jax.device_put(rng.standard_normal(s).astype(np.float32), gpus[0])  # noqa: E731
                    for i, s in enumerate(SHAPES)}
    params, grads_seq = tree(), [tree() for _ in range(10)]
    constructor, hyper, twin = JAX_TWINS[name]
    theirs = twin(optax)
    if form == "fused":
        ours = getattr(mtx, f"fused_{constructor}")(**hyper)
        step = jax.jit(lambda p, s, g: ours.step(p, g, s), donate_argnums=(0, 1))
    else:
        ours = getattr(mtx, constructor)(**hyper)
        step = jax.jit(lambda p, s, g: _apply(ours, optax, p, s, g), donate_argnums=(0, 1))
    their_step = jax.jit(lambda p, s, g: _apply(theirs, optax, p, s, g))
    mine, state = jax.tree.map(lambda x: x.copy(), params), ours.init(params)
    assert "mtapply_step" in step.lower(mine, state, grads_seq[0]).compile().as_text()
    want, their_state = params, theirs.init(params)
    for g in grads_seq:
        mine, state = step(mine, state, g)
        want, their_state = their_step(want, their_state, g)
    if name == "adan":
        _assert_as_close_to_float64_as_optax(mine, want, params, grads_seq)
        return
    for got, expected in zip(jax.tree.leaves(mine), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-6,
                                   err_msg=name)


def _assert_as_close_to_float64_as_optax(mine, theirs, params, grads_seq):
    """Adan divides by the root of a running mean of (g + (1 - beta2) * diff)^2, which is near
    zero for a few elements of a million: there any two float32 evaluations part by up to 1e-3.
    So both are measured against the same rule run in float64 (its semantics are checked
    against optax.adan on the CPU), and ours must be about as close as optax's."""
    from mtapply.rules import library

    lists = [[np.asarray(x, np.float64) for x in jax_leaves(params)]]
    lists += [[np.zeros(x.shape) for x in lists[0]] for _ in range(4)]
    p, m, v, n, prev = lists
    for step, g in enumerate(grads_seq, 1):
        g = [np.asarray(x, np.float64) for x in jax_leaves(g)]
        library.adan().step(p, g, m, v, n, prev, lr=1e-3, weight_decay=0.01, step=step)
    for kind, pick in (("max", np.max), ("mean", np.mean)):
        ours = pick(np.concatenate([np.abs(np.asarray(a, np.float64) - t).ravel()
                                    for a, t in zip(jax_leaves(mine), p)]))
        optax_error = pick(np.concatenate([np.abs(np.asarray(a, np.float64) - t).ravel()
                                           for a, t in zip(jax_leaves(theirs), p)]))
        assert ours <= 2 * optax_error + 1e-7, (kind, ours, optax_error)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _apply(tx, optax, params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


@pytest.mark.parametrize("name,make_ours,make_theirs", [
    ("adagrad", lambda p: mt.Adagrad(p, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1),
     lambda p: torch.optim.Adagrad(p, lr=0.05, lr_decay=0.01, initial_accumulator_value=0.1,
                                   foreach=False)),
    ("rmsprop", lambda p: mt.RMSprop(p, lr=1e-3, momentum=0.9, centered=True),
     lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.9, centered=True, foreach=False)),
    ("adamax", lambda p: mt.Adamax(p, lr=1e-3, weight_decay=0.01),
     lambda p: torch.optim.Adamax(p, lr=1e-3, weight_decay=0.01, foreach=False)),
    ("adadelta", lambda p: mt.Adadelta(p, lr=0.5, weight_decay=0.01),
     lambda p: torch.optim.Adadelta(p, lr=0.5, weight_decay=0.01, foreach=False)),
    ("nadam", lambda p: mt.NAdam(p, lr=1e-3, weight_decay=0.1, momentum_decay=0.01),
     lambda p: torch.optim.NAdam(p, lr=1e-3, weight_decay=0.1, momentum_decay=0.01,
                                 foreach=False)),
    ("radam", lambda p: mt.RAdam(p, lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True),
     lambda p: torch.optim.RAdam(p, lr=1e-3, weight_decay=0.1, decoupled_weight_decay=True,
                                 foreach=False)),
])
def test_shipped_torch_classes_match_torch_optim_on_the_gpu(name, make_ours, make_theirs):
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.Tanh(),
                               torch.nn.Linear(300, 10)).cuda()
    theirs = copy.deepcopy(ours)
    opt, ref = make_ours(ours.parameters()), make_theirs(theirs.parameters())
    for k in range(10):
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(k))
        for model, o in ((ours, opt), (theirs, ref)):
            o.zero_grad()
            model(x).square().mean().backward()
            o.step()
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_nadam_scalar_state_on_the_gpu_follows_the_cpu_path_over_two_launches():
    """NAdam's mu_product is scalar state: one thread of each launch writes the copy of the
    step's parity; params of two dtypes make two launches per step, a device found_inf skips
    one step (nothing written, the state included), and a CUDA graph replays a step."""
    from mtapply.rules import library

    rule = library.nadam(True)
    hyper = dict(lr=1e-2, weight_decay=0.1, momentum_decay=0.01)
    lists = _lists(len(rule.slots), 5)
    lists[0][1], lists[1][1] = lists[0][1].to(torch.bfloat16), lists[1][1].to(torch.bfloat16)
    host = _host(lists)
    state = torch.tensor(rule.initial_scalars(), device="cuda")
    host_state = rule.initial_scalars()
    skip = torch.ones(1, device="cuda")
    for step in range(1, 6):
        if step == 3:  # skipped on the device: the next call steps 3 again
            rule.step(*lists, step=step, scalars_out=state, found_inf=skip, **hyper)
        rule.step(*lists, step=step, scalars_out=state, **hyper)
        rule.step(*host, step=step, scalars_out=host_state, **hyper)
    torch.cuda.synchronize()
    np.testing.assert_allclose(state.cpu().numpy(), host_state, rtol=1e-6)
    for i, (got, want) in enumerate(zip(lists[0], host[0])):
        if i == 1:  # bf16 params: compared after rounding
            want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
        np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=2e-2 if i == 1 else 2e-5,
                                   atol=2e-6, err_msg=f"param[{i}]")
    plan = rule.plan(*lists)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.step(step=6, scalars_out=state, **hyper)
        with torch.cuda.graph(graph, stream=side):
            plan.step(step=7, scalars_out=state, **hyper)
    torch.cuda.synchronize()
    after_six = state.clone()
    graph.replay()  # step 7 reads copy 0 (step 6's) and writes copy 1, each replay alike
    graph.replay()
    torch.cuda.synchronize()
    assert state[0].item() == after_six[0].item()
    rule.step(*host, step=6, scalars_out=host_state, **hyper)
    rule.step(*host, step=7, scalars_out=host_state, **hyper)
    np.testing.assert_allclose(state.cpu().numpy(), host_state, rtol=1e-6)


@pytest.mark.parametrize("kind", ["plain", "lamb", "global-norm"])
def test_a_chain_of_links_on_the_gpu_follows_the_cpu_path(kind):
    """optax-style links fused into one rule (`mtapply.chain`): one launch per dtype group
    over the big and the empty tensors alike (LAMB's: a first pass sums the norms; the global
    norm's: a first pass sums over the whole list, which one block of it adds up)."""
    from mtapply.rules import library as L

    rule = {"plain": lambda: mtapply.chain(L.clip(2.0), L.scale_by_adam(b1=0.8),
                                           L.add_decayed_weights(0.01),
                                           L.trace(0.5, nesterov=True), L.scale_by_learning_rate()),
            "lamb": lambda: mtapply.chain(L.scale_by_adam(eps=1e-6), L.add_decayed_weights(0.01),
                                          L.scale_by_trust_ratio(), L.scale_by_learning_rate()),
            "global-norm": lambda: mtapply.chain(L.clip_by_global_norm(5.0), L.scale_by_adam(),
                                                 L.add_decayed_weights(0.01),
                                                 L.scale_by_learning_rate())}[kind]()
    lists = _lists(len(rule.slots), 7)
    host = _host(lists)
    for step in range(1, 5):
        rule.step(*lists, lr=1e-2, step=step)
        rule.step(*host, lr=1e-2, step=step)
    torch.cuda.synchronize()
    for k, slot in enumerate(rule.slots):
        for i, (got, want) in enumerate(zip(lists[k], host[k])):
            np.testing.assert_allclose(got.cpu().numpy(), want, rtol=2e-5, atol=2e-6,
                                       err_msg=f"{slot}[{i}]")


def test_a_whole_list_sum_spans_every_launch_of_the_step():
    """Params of two dtypes make two launches; the global norm adds both groups' tensors
    (fixed order: the same on every run), and a CUDA graph replays the two passes."""
    rule = mtapply.rule("clipped_sgd", slots="param:rw grad:r", hyper=dict(lr=None, max_norm=1.0),
                        totals={"g2": "grad * grad"},
                        update="param = param - lr * grad * min(1, max_norm / sqrt(g2 + 1e-12))")
    lists = _lists(2, 11)
    lists[0][4], lists[1][4] = lists[0][4].to(torch.bfloat16), lists[1][4].to(torch.bfloat16)
    host = _host(lists)
    plan = rule.plan(*lists)
    plan.step(lr=0.5)
    rule.step(*host, lr=0.5)
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(lists[0], host[0])):
        if lists[0][i].dtype == torch.bfloat16:
            want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
        np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=1e-2 if i == 4 else 1e-5,
                                   atol=1e-6, err_msg=f"param[{i}]")
    again = [x.clone() for x in lists[0]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph, stream=side):
        plan.step(lr=0.5)
    graph.replay()
    rule.step(*host, lr=0.5)
    torch.cuda.synchronize()
    assert not torch.equal(lists[0][0], again[0])
    np.testing.assert_allclose(lists[0][0].cpu().numpy(), host[0][0], rtol=1e-5, atol=1e-6)


PRODIGY_HYPER = dict(lr=1.0, beta3=0.999 ** 0.5, weight_decay=0.01)


def _prodigy_steps(rule, lists, dtype, steps=7):
    """`steps` Prodigy steps of a quadratic on the GPU and on the CPU path, from params and
    grads `lists`: (GPU lists, host lists, GPU state, host state), the state of `dtype`."""
    targets = [x.clone() * 0.5 for x in lists[0]]
    lists = lists + [[torch.zeros_like(x) for x in lists[0]] for _ in range(3)] + [
        [x.clone() for x in lists[0]]]
    host = _host(lists)
    state = torch.tensor(rule.initial_scalars(dtype), device="cuda")
    host_state = rule.initial_scalars(dtype)
    for t in range(1, steps + 1):
        for g, p, y in zip(lists[1], lists[0], targets):
            g.copy_(p - y)
        for k, (p, y) in enumerate(zip(host[0], targets)):
            host[1][k][...] = p - y.cpu().numpy()
        rule.step(*lists, step=t, scalars_out=state, **PRODIGY_HYPER)
        rule.step(*host, step=t, scalars_out=host_state, **PRODIGY_HYPER)
    torch.cuda.synchronize()
    return lists, host, state, host_state


def test_prodigy_on_the_gpu_follows_the_cpu_path():
    """Scalar state (d, d_max, d_numerator) fed by two whole-list sums, over the big tensor."""
    from mtapply.rules import library

    rule = library.prodigy()
    lists, host, state, host_state = _prodigy_steps(rule, _lists(2, 13), np.float32)
    np.testing.assert_allclose(state.cpu().numpy(), host_state, rtol=1e-4)
    assert host_state[6] > 1e-6  # d grew
    for i, (got, want) in enumerate(zip(lists[0], host[0])):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4, atol=1e-5, err_msg=f"{i}")


def test_float64_params_keep_float64_sums_and_scalar_state_on_the_gpu():
    """Prodigy over float64 params: its whole-list sums and d are float64 on the GPU, which
    follows the CPU path to float64 rounding (float32 sums would leave d some 1e-7 off); a
    float32 state array is refused before anything is written. LARS's per-tensor norms over
    float64 params are float64 too, and a list of float32 and float64 params sums in float32."""
    from mtapply.rules import library

    rule = library.prodigy()
    params, grads = _lists(2, 17, dtype=torch.float64)
    before = [x.clone() for x in params]
    with pytest.raises(ValueError, match="float64 array.*initial_scalars"):
        rule.step(params, grads, *[[torch.zeros_like(x) for x in params] for _ in range(4)],
                  step=1, scalars_out=torch.tensor(rule.initial_scalars(), device="cuda"),
                  **PRODIGY_HYPER)
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    lists, host, state, host_state = _prodigy_steps(rule, [params, grads], np.float64)
    assert state.dtype == torch.float64 and host_state[6] > 1e-6  # d grew
    np.testing.assert_allclose(state.cpu().numpy(), host_state, rtol=1e-12)
    for i, (got, want) in enumerate(zip(lists[0], host[0])):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-12, atol=1e-14,
                                   err_msg=f"{i}")
    params, grads = _lists(2, 18, dtype=torch.float64)
    want = np.array([[float(p.square().sum()), float(g.square().sum())]
                     for p, g in zip(params, grads)])  # (the norms are taken before the update)
    plan = mtapply.lars_plan(params, grads, [torch.zeros_like(p) for p in params])
    plan.step(lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=1e-3)
    sums = plan.sums()
    assert sums.dtype == np.float64
    np.testing.assert_allclose(np.sort(sums.get(), axis=0), np.sort(want, axis=0),
                               rtol=1e-13)
    mixed = [params[0].float()] + params[1:]
    mixed_plan = mtapply.lars_plan(mixed, [g.to(p.dtype) for g, p in zip(grads, mixed)],
                                   [torch.zeros_like(p) for p in mixed])
    mixed_plan.step(lr=0.1, momentum=0.9, weight_decay=1e-4, trust_coefficient=1e-3)
    assert mixed_plan.sums().dtype == np.float32 and mixed_plan.sum_dtype == "float32"


@pytest.mark.parametrize("form", ["transformation", "fused"])
def test_a_global_norm_chain_through_the_ffi_call_follows_optax(form):
    """clip_by_global_norm -> adamw as one mtapply rule in JAX: its whole-list sum inside the
    FFI call's two passes, against optax.chain of optax's links."""
    jax = pytest.importorskip("jax")
    optax = pytest.importorskip("optax")
    import mtapply.optax as mtx
    from mtapply.rules import library as L

    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        pytest.skip("jax has no GPU backend here")
    rule = mtapply.chain(L.clip_by_global_norm(5.0), L.scale_by_adam(), L.add_decayed_weights(0.01),
                         L.scale_by_learning_rate())
    rng = np.random.default_rng(5)
    tree = lambda: {f"p{i}": jax.device_put(rng.standard_normal(s).astype(np.float32), gpus[0])  # noqa: E731
                    for i, s in enumerate(SHAPES)}
    params, grads_seq = tree(), [tree() for _ in range(5)]
    theirs = optax.chain(optax.clip_by_global_norm(5.0), optax.scale_by_adam(),
                         optax.add_decayed_weights(0.01), optax.scale_by_learning_rate(1e-3))
    if form == "fused":
        ours = mtx.fused(rule, 1e-3)
        step = jax.jit(lambda p, s, g: ours.step(p, g, s), donate_argnums=(0, 1))
    else:
        ours = mtx.transformation(rule, 1e-3)
        step = jax.jit(lambda p, s, g: _apply(ours, optax, p, s, g), donate_argnums=(0, 1))
    their_step = jax.jit(lambda p, s, g: _apply(theirs, optax, p, s, g))
    mine, state = jax.tree.map(lambda x: x.copy(), params), ours.init(params)
    want, their_state = params, theirs.init(params)
    for g in grads_seq:
        mine, state = step(mine, state, g)
        want, their_state = their_step(want, their_state, g)
    for got, expected in zip(jax.tree.leaves(mine), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=2e-5, atol=2e-6)


CLIPPED_SGD = dict(slots="param:rw grad:r",
                   hyper=dict(lr=(None, ">= 0"), max_norm=(1.0, "> 0"), global_norm=(None, ">= 0")),
                   update="param = param - lr * grad * min(1, max_norm / (global_norm + 1e-6))")


@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_a_global_norm_from_l2_norms_is_a_device_hyperparameter(framework):
    """A rule that clips by a global norm it takes as a hyperparameter: the one-element norm
    mtapply.l2_norms leaves on the GPU goes in as it is, and the step is the CPU path's with the
    norm computed there."""
    rule = mtapply.rule("clipped_sgd", **CLIPPED_SGD)
    params, grads = _lists(2, 7)
    host = _host([params, grads])
    if framework == "cupy":
        cupy = pytest.importorskip("cupy")
        params, grads = ([cupy.from_dlpack(x) for x in column] for column in (params, grads))
    for step in range(3):
        _, total = mtapply.l2_norms(grads)
        rule.step(params, grads, lr=0.1, max_norm=2.0, global_norm=total)
        _, host_total = mtapply.l2_norms(host[1])
        rule.step(*host, lr=0.1, max_norm=2.0, global_norm=host_total)
    for i, (got, want) in enumerate(zip(params, host[0])):
        got = torch.from_dlpack(got).cpu().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"param {i}")
        assert not np.array_equal(got, _numpy(_lists(1, 7)[0][i])) or got.size == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bfloat16_rounds_on_the_gpu_as_torch_and_the_cpu_path(dtype):
    rule = mtapply.rule("rounding", **ROUNDING)
    g = torch.Generator().manual_seed(6)
    grads = torch.cat([torch.tensor([*ROUNDED, float("nan")], dtype=dtype),
                       torch.randn(1 << 20, generator=g, dtype=dtype) * 1e3]).cuda()
    params = torch.full_like(grads, 7.0)
    host = [params.cpu().numpy()], [grads.cpu().numpy()]
    rule.step([params], [grads], k=1 + 3 * TIE)
    rule.step(*host, k=1 + 3 * TIE)
    got = params.cpu()
    np.testing.assert_array_equal(got.numpy(), host[0][0])
    torch.testing.assert_close(got, grads.cpu().to(torch.bfloat16).to(dtype) * (1 + 4 * TIE),
                               rtol=0, atol=0, equal_nan=True)
