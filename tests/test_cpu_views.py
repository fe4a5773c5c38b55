"""The CPU backend reads tensors stored in the math type through read-only views of their
memory and steps small tensors together: results that alias another slot's memory are still
written as computed, inputs are never written, and stepping together changes no value."""
import numpy as np
import pytest

from mtapply import _cpu
from mtapply.ops.scaling import _ElementwiseSpec
from mtapply.plan import Plan
from mtapply.rules import library


class SwapSpec(_ElementwiseSpec):
    """a, b = b, a: each result is the other slot's own values (its memory, on the CPU)."""

    name = "swap"
    functor = "mta::Swap"
    slots = ("a", "b")
    written = frozenset({"a", "b"})
    flags = ()

    def __init__(self, batchable: bool):
        self.batchable = batchable

    def arguments(self) -> dict:
        return {}

    def cpu_update(self, arrays: dict, args: dict, dtype, index: int) -> dict:
        return {"a": arrays["b"], "b": arrays["a"]}

    def cpu_batchable(self) -> bool:
        return self.batchable


@pytest.mark.parametrize("batchable", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_results_that_are_another_slots_memory_are_written_as_returned(batchable, dtype):
    a = [np.arange(n, dtype=dtype) for n in (5, 3, 70_000)]
    b = [-np.arange(n, dtype=dtype) - 1 for n in (5, 3, 70_000)]
    want_a, want_b = [x.copy() for x in b], [x.copy() for x in a]
    Plan(SwapSpec(batchable), {"a": a, "b": b}).step()
    for got, want in zip(a + b, want_a + want_b):
        np.testing.assert_array_equal(got, want)


def test_loaded_views_are_read_only_and_grads_are_never_written():
    rng = np.random.default_rng(0)
    shapes = [(7,), (3, 5), (40_000,), (1,)]
    params = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    buffers = [np.zeros(s, np.float32) for s in shapes]
    before = [g.copy() for g in grads]
    plan = library.sgd(True, False, False).plan(params, grads, buffers)
    plan.step(lr=0.1, step=1.0, momentum=0.9, dampening=0.0, weight_decay=0.0)
    for g, was, buf in zip(grads, before, buffers):
        np.testing.assert_array_equal(g, was)
        np.testing.assert_array_equal(buf, was)  # step 1: the buffer takes the gradient
    ref = plan._refs["grads"][0]
    assert not _cpu.load(ref, np.float32).flags.writeable
    assert _cpu.load(ref, np.float64).flags.writeable  # converted: a new array


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_small_tensors_stepped_together_step_as_one_by_one(dtype):
    rng = np.random.default_rng(1)
    shapes = [(7,), (3, 5), (20_000,), (1,), (0,), (33,)]

    def run(together: bool):
        lists = [[rng_values(rng, s, dtype) for s in shapes] for _ in range(3)]
        plan = library.lion().plan(*lists)
        if not together:
            plan._cpu_cache = None
        for step in (1.0, 2.0):
            plan.step(lr=1e-2, beta1=0.9, beta2=0.99, weight_decay=0.1, step=step)
        return lists

    state = rng.bit_generator.state
    one_by_one = run(False)
    rng.bit_generator.state = state
    together = run(True)
    for got_list, want_list in zip(together, one_by_one):
        for got, want in zip(got_list, want_list):
            np.testing.assert_array_equal(got, want)


def rng_values(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)
