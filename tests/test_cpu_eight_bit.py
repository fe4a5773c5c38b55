"""8-bit state stepped in place on the CPU (`mtapply._cpu_eight_bit`): params, codes and scales
are those of the NumPy reference path (`reference.adam8bit`), bit for bit, on one thread and on
several, with ragged last blocks, tensors under 4096 elements, and NaN, infinite, zero and
subnormal blocks; Adam's pieces stepped by the native library and by NumPy (MTAPPLY_NATIVE=0)."""
from __future__ import annotations

import numpy as np
import pytest

import mtapply
from mtapply import _cpu, _cpu_eight_bit, _native, quantization, reference
from mtapply.rules import library

# pieces of 65,536 elements and a ragged rest; whole and ragged blocks; tensors under 4096
SHAPES = [(2 * 65536 + 300,), (256, 300), (4095,), (5000,), (257,), (3,), (1,)]
OPTIONS = [dict(decoupled_weight_decay=True, weight_decay=0.01, maximize=False, beta1=0.9),
           dict(decoupled_weight_decay=False, weight_decay=0.1, maximize=True, beta1=0.9),
           dict(decoupled_weight_decay=False, weight_decay=0.0, maximize=False, beta1=0.3)]


def _problem(seed: int, threshold: int):
    """Params, grads per step, and a state of random 8-bit moments (float32 under
    `threshold` elements), with special blocks in the largest tensor."""
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    state = mtapply.adam8bit_state(params, threshold=threshold)
    for k, p in enumerate(params):
        m = (rng.standard_normal(p.shape) * 0.1).astype(np.float32)
        v = (np.abs(rng.standard_normal(p.shape)) * 0.01).astype(np.float32)
        if k == 0:
            m[:256], v[:256] = 0.0, 0.0  # a zero block: absmax 0
            v[1024:1280] = np.float32(1e-42)  # subnormal second moments
        if state.exp_avgs[k].dtype == np.float32:
            state.exp_avgs[k][...], state.exp_avg_sqs[k][...] = m, v
            continue
        for values, codes, scales, signed in (
                (m, state.exp_avgs[k], state.exp_avg_absmax[k], True),
                (v, state.exp_avg_sqs[k], state.exp_avg_sq_absmax[k], False)):
            c, s = quantization.quantize_blockwise(values, signed)
            codes[...], scales[...] = c.reshape(codes.shape), s
    grads = []
    for _ in range(3):
        step_grads = [(rng.standard_normal(s) * 1e-2).astype(np.float32) for s in SHAPES]
        step_grads[0][:256] = 0.0
        step_grads[0][300], step_grads[0][70_000] = np.inf, np.nan  # whole blocks set to zero
        step_grads[0][1024:1280] = np.float32(1e-30)  # a subnormal v * (1 - beta2)
        grads.append(step_grads)
    return params, grads, state


@np.errstate(all="ignore")
def _reference_step(params, grads, columns, t, options):
    for k, (p, g) in enumerate(zip(params, grads)):
        m, v, ms, vs = (column[k] for column in columns)
        step_options = dict(options, lr=1e-2, step=t, dtype=np.float32)
        if m.dtype == np.float32:
            p2, m2, v2, _ = reference.adam(p, g, m, v, **step_options)
            columns[0][k], columns[1][k] = m2, v2
        else:
            p2, (mc, ms2), (vc, vs2) = reference.adam8bit(
                p, g, (m.reshape(-1), ms), (v.reshape(-1), vs), **step_options)
            columns[0][k], columns[1][k] = mc.reshape(m.shape), vc.reshape(v.shape)
            columns[2][k], columns[3][k] = ms2, vs2
        params[k] = p2.astype(np.float32).reshape(p.shape)


def _same_bits(got, want, name):
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes(), name


def _same_bits_nan_alike(got, want, name):
    """Bit for bit, but that a NaN may be any NaN: its sign and payload follow how NumPy and
    the C++ compiler order operations, which neither promises."""
    assert got.dtype == want.dtype and got.shape == want.shape, name
    if got.dtype.kind != "f":
        return _same_bits(got, want, name)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan), f"{name}: NaNs at other places"
    _same_bits(got[~nan], want[~nan], name)


def _use_native(native: str, monkeypatch) -> None:
    monkeypatch.setenv("MTAPPLY_NATIVE", native)
    if native == "1" and _native.library("cpu_eight_bit") is None:
        pytest.skip("the native library cpu_eight_bit could not be built here")


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "numpy"])
@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("threshold", [1, 4096])
@pytest.mark.parametrize("options", OPTIONS, ids=["adamw", "adam-maximize", "beta1-0.3"])
def test_pieces_step_as_the_reference(options, threshold, threads, native, monkeypatch):
    _use_native(native, monkeypatch)
    monkeypatch.setenv("MTAPPLY_CPU_THREADS", threads)
    monkeypatch.setattr(_cpu, "THREAD_MIN", 1 << 12)  # a thread for every piece here
    params, grads, state = _problem(0, threshold)
    want = [p.copy() for p in params]
    want_columns = [[x.copy() for x in column] for column in state.lists()]
    hyper = {k: v for k, v in options.items() if k in ("weight_decay", "beta1")}
    flags = {k: v for k, v in options.items() if k not in hyper}
    plan = mtapply.adam8bit_plan(params, grads[0], *state.lists(), **flags)
    for t, step_grads in enumerate(grads, 1):
        plan.rebind("grads", step_grads)
        plan.step(lr=1e-2, step=t, **hyper)
        _reference_step(want, step_grads, want_columns, t, options)
    assert plan._cpu_cache.get("eight_bit")  # the in-place path ran
    assert bool(plan._cpu_cache.get("eight_bit_native")) == (native == "1")
    for k in range(len(SHAPES)):
        _same_bits_nan_alike(params[k], want[k], f"params[{k}]")
        for column, expected, name in zip(state.lists(), want_columns, ("m", "v", "ms", "vs")):
            _same_bits_nan_alike(column[k], expected[k], f"{name}[{k}]")


@pytest.mark.parametrize("native", ["1", "0"], ids=["native", "numpy"])
def test_torch_adamw8bit_steps_as_the_reference(native, monkeypatch):
    torch = pytest.importorskip("torch")
    _use_native(native, monkeypatch)
    import mtapply.torch as mt

    rng = np.random.default_rng(2)
    shapes = [(2 * 65536 + 300,), (64, 129), (5000,)]
    params = [torch.nn.Parameter(torch.from_numpy(rng.standard_normal(s).astype(np.float32)))
              for s in shapes]
    opt = mt.AdamW8bit(params, lr=1e-2, weight_decay=0.01)
    for t in range(1, 4):
        for p in params:
            p.grad = torch.from_numpy((rng.standard_normal(p.shape) * 1e-2).astype(np.float32))
        before = [(p.detach().numpy().copy(), {k: v.numpy().copy() for k, v in opt.state[p].items()
                                               if k != "step"} if opt.state[p] else None)
                  for p in params]
        opt.step()
        for p, (value, state) in zip(params, before):
            if state is None:
                continue
            p2, (mc, ms), (vc, vs) = reference.adam8bit(
                value, p.grad.numpy(), (state["exp_avg"].reshape(-1), state["exp_avg_absmax"]),
                (state["exp_avg_sq"].reshape(-1), state["exp_avg_sq_absmax"]), lr=1e-2,
                step=t, weight_decay=0.01, decoupled_weight_decay=True)
            got = opt.state[p]
            _same_bits_nan_alike(p.detach().numpy(), p2.astype(np.float32), "param")
            _same_bits_nan_alike(got["exp_avg"].numpy().reshape(-1), mc, "exp_avg")
            _same_bits_nan_alike(got["exp_avg_sq"].numpy().reshape(-1), vc, "exp_avg_sq")
            _same_bits_nan_alike(got["exp_avg_absmax"].numpy(), ms, "exp_avg_absmax")
            _same_bits_nan_alike(got["exp_avg_sq_absmax"].numpy(), vs, "exp_avg_sq_absmax")


# a temporary read after the slot it copied is assigned, and a slot given another's old values
ALIASES = mtapply.rule("aliases", slots="param:rw grad:r a:rw b:rw", hyper={"lr": None}, update="""
    old_a = a
    a = where(step == 1, b, a * 0.5 + grad)
    b = old_a
    param = param - lr * (old_a + a)
""")
RULES = [("lion", library.lion(), {}, dict(lr=1e-3, weight_decay=0.1)),
         ("sgd", library.sgd(True), {}, dict(lr=1e-2, momentum=0.9)),
         ("adam", library.adam(True), dict(unsigned="exp_avg_sq"), dict(lr=1e-2, weight_decay=0.1)),
         ("adam-m", library.adam(), dict(slots="exp_avg"), dict(lr=1e-2)),  # v stays float32
         ("aliases", ALIASES, {}, dict(lr=0.1))]


def _run_rule(rule, hyper, in_place: bool, monkeypatch) -> list:
    if not in_place:  # each tensor dequantized, stepped and quantized whole (`cpu_update`)
        monkeypatch.setattr(_cpu_eight_bit, "run", lambda *args: frozenset())
    rng = np.random.default_rng(3)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    grads = [[(rng.standard_normal(s) * 1e-2).astype(np.float32) for s in SHAPES]
             for _ in range(4)]
    grads[1][0][300] = np.inf
    state = rule.state(params)
    plan = rule.plan(params, grads[0], *state)
    for t, step_grads in enumerate(grads, 1):
        plan.rebind("grads", step_grads)
        plan.step(step=t, **hyper)
    assert bool(plan._cpu_cache.get("eight_bit")) == in_place
    monkeypatch.undo()
    return params + [x for column in state for x in column]


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("threshold", [1, 4096])
@pytest.mark.parametrize("name,rule,bits,hyper", RULES, ids=[name for name, *_ in RULES])
def test_rules_with_8_bit_slots_step_as_their_reference_path(name, rule, bits, hyper, threshold,
                                                             threads, monkeypatch):
    eight = rule.with_state_bits(8, threshold=threshold, **bits)
    want = _run_rule(eight, hyper, False, monkeypatch)
    monkeypatch.setenv("MTAPPLY_CPU_THREADS", threads)
    monkeypatch.setattr(_cpu, "THREAD_MIN", 1 << 12)
    got = _run_rule(eight, hyper, True, monkeypatch)
    for k, (a, b) in enumerate(zip(got, want)):
        _same_bits_nan_alike(a, b, f"array {k}")



def _special_run(native: str, options: dict, monkeypatch) -> list:
    """Three steps of params and grads holding NaNs of either sign, infinities and subnormal
    moments; every array after them."""
    _use_native(native, monkeypatch)
    rng = np.random.default_rng(5)
    shapes = [(65536 + 700,), (900,)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    params[0][[5, 9000, 65600]] = [np.nan, -np.nan, np.inf]
    state = mtapply.adam8bit_state(params, threshold=1)
    hyper = {k: v for k, v in options.items() if k in ("weight_decay", "beta1")}
    flags = {k: v for k, v in options.items() if k not in hyper}
    plan = None
    for t in range(1, 4):
        grads = [(rng.standard_normal(s) * 1e-2).astype(np.float32) for s in shapes]
        grads[0][[7, 9001, 40000, 66000]] = [-np.nan, np.nan, -np.inf, np.nan]
        grads[0][2048:2304] = np.float32(1e-40)  # subnormal first and second moments
        grads[1][100] = -np.inf
        if plan is None:
            plan = mtapply.adam8bit_plan(params, grads, *state.lists(), **flags)
        plan.rebind("grads", grads)
        plan.step(lr=1e-2, step=t, **hyper)
    assert bool(plan._cpu_cache.get("eight_bit_native")) == (native == "1")
    return params + [x for column in state.lists() for x in column]


@pytest.mark.parametrize("options", OPTIONS, ids=["adamw", "adam-maximize", "beta1-0.3"])
def test_native_steps_special_values_as_numpy(options, monkeypatch):
    got = _special_run("1", options, monkeypatch)
    want = _special_run("0", options, monkeypatch)
    for k, (a, b) in enumerate(zip(got, want)):
        _same_bits_nan_alike(a, b, f"array {k}")
