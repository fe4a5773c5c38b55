"""Tensors stored in the math type are updated straight in their memory, a range of elements at
a time and on several threads (`mtapply._cpu._run_in_place`): the values are those of the
tensor-by-tensor update, bit for bit, NaN, infinities, signed zeros and subnormals included."""
from __future__ import annotations

import time

import numpy as np
import pytest

import mtapply
from mtapply import _cpu
from mtapply.rules import _numpy, library

SHAPES = [(70_000,), (5,), (256, 300), (3,)]  # pieces of CHUNK and a rest; enough for threads
SPECIAL = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-40, -3e-39, 1e30, 1.0, -1.0]

# a temporary read after the slot it copied is assigned, results that are other slots' values
# from before the step, uniform and elementwise where, and every function of the language
ALIASES = mtapply.rule("aliases", slots="param:rw grad:r a:rw b:rw", hyper={"lr": None}, update="""
    old_a = a
    a = where(step == 1, b, a * 0.5 + grad)
    b = old_a
    param = param - lr * (old_a + a)
""")
SWAP = mtapply.rule("swap", slots="param:rw grad:r a:rw b:rw", hyper={"lr": None}, update="""
    t = a
    a = b
    b = t
    param = +param
""")
EVERY_FUNCTION = mtapply.rule("every_function", slots="param:rw grad:r m:rw", hyper={"lr": None},
                              update="""
    u = -grad * (1 - 0) + m ** 2 - abs(m) ** 0.5 + rsqrt(abs(grad) + 1) / sign(grad)
    u = where(u > 0, exp(-abs(u)), log(abs(u) + 1)) + min(u, m) - max(m, -u) + u % 3 + u ** 1.5
    m = where(lr != 0, m * (1 - lr) + u, 0)
    param = where(step > 1, param - lr * u, param)
""")


def _rules():
    yield "sgd", library.sgd()
    for nesterov in (False, True):
        yield f"sgd-momentum-n{int(nesterov)}", library.sgd(True, nesterov)
    yield "sgd-maximize", library.sgd(True, False, True)
    yield "lion", library.lion()
    yield "adam", library.adam(True)
    yield "adan", library.adan()
    yield "ademamix", library.ademamix()
    yield "adadelta", library.adadelta()
    yield "adagrad", library.adagrad()
    yield "radam", library.radam()
    yield "rmsprop", library.rmsprop(True, True, True)
    yield "schedule-free-adamw", library.schedule_free_adamw()
    yield "aliases", ALIASES
    yield "swap", SWAP
    yield "every-function", EVERY_FUNCTION


RULES = list(_rules())


def _lists(rule, dtype, seed: int) -> list:
    rng = np.random.default_rng(seed)
    lists = []
    for _ in rule.slots:
        tensors = [rng.standard_normal(shape).astype(dtype) for shape in SHAPES]
        for t in tensors:
            t.reshape(-1)[:len(SPECIAL)] = np.array(SPECIAL[:t.size], dtype)[rng.permutation(
                min(t.size, len(SPECIAL)))]
        lists.append(tensors)
    return lists


def _hyper(rule, step: float) -> dict:
    """Defaults, lr 1e-2, and a momentum and weight decay where the rule has them."""
    hyper = {name: 1e-2 if default is None else default for name, default in rule.hyper.items()}
    hyper.update({name: value for name, value in (("momentum", 0.9), ("weight_decay", 0.01))
                  if name in hyper})
    return dict(hyper, step=step)


def _run(rule, dtype, in_place: bool, seed: int = 0) -> list:
    lists = _lists(rule, dtype, seed)
    plan = rule.plan(*lists)
    if not in_place:
        plan._cpu_cache = None
    for step in (1.0, 2.0, 3.0):
        plan.step(**_hyper(rule, step))
    if in_place:  # the path under test was taken
        assert plan._cpu_cache.get("in_place")
    return lists


def _assert_same_bits(got_lists, want_lists):
    for got_list, want_list in zip(got_lists, want_lists):
        for got, want in zip(got_list, want_list):
            assert got.view(np.uint8).tobytes() == want.view(np.uint8).tobytes()


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name,rule", RULES, ids=[name for name, _ in RULES])
def test_in_place_steps_as_one_by_one(name, rule, dtype, threads, monkeypatch):
    monkeypatch.setenv("MTAPPLY_CPU_THREADS", threads)
    monkeypatch.setattr(_cpu, "THREAD_MIN", 1 << 12)  # a thread for every piece here
    _assert_same_bits(_run(rule, dtype, True), _run(rule, dtype, False))


def test_a_slot_read_through_a_temporary_after_its_last_line_is_not_written_early():
    direct = _numpy.direct_lines(ALIASES.program)
    assert "a" not in direct.values() and "b" not in direct.values()
    assert set(library.sgd(True).program.lines[k].target
               for k in _numpy.direct_lines(library.sgd(True).program)) == {
        "param", "momentum_buffer"}


def test_a_slot_given_a_uniform_value_takes_the_tensor_by_tensor_path():
    """Such a slot's value stays a float64 number in the lines that read it."""
    rule = mtapply.rule("uniform_slot", slots="param:rw grad:r m:rw", hyper={"lr": None},
                        update="m = lr * 3\nparam = param - m * grad")
    assert _numpy.compiled(rule.program).into is None
    params, grads, moments = ([np.full(70_000, v, np.float32)] for v in (1.0, 0.5, 0.0))
    plan = rule.plan(params, grads, moments)
    plan.step(lr=0.1)
    assert not plan._cpu_cache.get("in_place")
    np.testing.assert_array_equal(moments[0], np.float32(0.1 * 3))


def test_tensors_stored_in_other_types_take_the_tensor_by_tensor_path():
    params = [np.ones(70_000, np.float16), np.ones(70_000, np.float32)]
    grads = [np.ones(70_000, np.float16), np.ones(70_000, np.float32)]
    buffers = [np.zeros(70_000, np.float16), np.zeros(70_000, np.float32)]
    plan = library.sgd(True).plan(params, grads, buffers)
    plan.step(lr=0.5, step=1.0, momentum=0.9, dampening=0.0, weight_decay=0.0)
    assert plan._cpu_cache["in_place"] == frozenset({1})
    for p, b in zip(params, buffers):
        np.testing.assert_array_equal(p, 0.5)
        np.testing.assert_array_equal(b, 1.0)


def test_threads_follow_the_environment(monkeypatch):
    monkeypatch.setenv("MTAPPLY_CPU_THREADS", "3")
    assert _cpu._threads() == 3
    monkeypatch.delenv("MTAPPLY_CPU_THREADS")
    assert 1 <= _cpu._threads() <= 8
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("MTAPPLY_CPU_THREADS", bad)
        with pytest.raises(ValueError, match="MTAPPLY_CPU_THREADS"):
            _cpu._threads()


def _step_with_sums(rule, threads: str, monkeypatch, **hyper) -> list:
    """Four steps of `rule` (it takes sums: stepped tensor by tensor) over fixed tensors, on
    `threads` threads; each slot's values after them (a second moment kept >= 0)."""
    monkeypatch.setenv("MTAPPLY_CPU_THREADS", threads)
    monkeypatch.setattr(_cpu, "THREAD_MIN", 1 << 10)  # a thread for every tensor here
    rng = np.random.default_rng(7)
    shapes = [(300, 200), (7,), (64, 513), (3, 40, 50), (20_000,), (1,)]
    lists = [[np.asarray(rng.standard_normal(s), np.float32) for s in shapes]
             for _ in rule.slots]
    for x in lists[-1]:
        np.abs(x, out=x)
    plan = rule.plan(*lists)
    for step in range(1, 5):
        plan.step(step=step, **hyper)
    return lists


@pytest.mark.parametrize("name,rule,hyper", [
    ("lars", library.lars(), dict(lr=0.1, weight_decay=1e-4)),
    ("lamb", library.lamb(), dict(lr=0.01)),
])
def test_rules_with_sums_step_tensors_on_threads_as_one_by_one(name, rule, hyper, monkeypatch):
    """A rule that takes per-tensor sums steps its tensors one by one (`cpu_update`), on
    several threads where they are large: the same bits as on one."""
    calls = []
    threaded = _cpu.on_threads

    def spy(items, step, elements, errors=None):
        calls.append((len(items), min(_cpu._threads(), elements // _cpu.THREAD_MIN + 1)))
        threaded(items, step, elements, errors)

    monkeypatch.setattr(_cpu, "on_threads", spy)
    got = _step_with_sums(rule, "3", monkeypatch, **hyper)
    assert calls == [(6, 3)] * 4  # every step's six tensors, three threads
    want = _step_with_sums(rule, "1", monkeypatch, **hyper)
    _assert_same_bits(got, want)
    start = np.asarray(np.random.default_rng(7).standard_normal((300, 200)), np.float32)
    assert np.abs(got[0][0] - start).max() > 1e-4  # the params moved


def test_a_step_that_raises_stops_every_thread_before_the_error_comes(monkeypatch):
    monkeypatch.setenv("MTAPPLY_CPU_THREADS", "3")
    done = []

    def step(item):
        if item == 1:
            raise RuntimeError("boom")
        time.sleep(0.02)
        done.append(item)

    with pytest.raises(RuntimeError, match="boom"):
        _cpu.on_threads(list(range(40)), step, 1 << 30)
    after = len(done)
    time.sleep(0.1)
    assert len(done) == after < 38  # the items no thread had taken are left undone


@pytest.mark.parametrize("threads", ["1", "3"])
def test_tensors_stepped_on_threads_keep_the_callers_numpy_errors(threads, monkeypatch):
    """float16 params that overflow when stored: the caller's np.errstate holds on the
    threads as on its own (here: raise)."""
    monkeypatch.setenv("MTAPPLY_CPU_THREADS", threads)
    monkeypatch.setattr(_cpu, "THREAD_MIN", 1 << 10)
    rng = np.random.default_rng(0)
    shapes = [(300, 200), (64, 513)]
    lists = [[np.asarray(rng.standard_normal(s), np.float16) for s in shapes] for _ in range(2)]
    lists += [[np.zeros(s, np.float32) for s in shapes] for _ in range(2)]
    with np.errstate(over="raise"), pytest.raises(FloatingPointError, match="overflow"):
        library.lamb().step(*lists, lr=1e6, step=1)
