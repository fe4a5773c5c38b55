"""A plan is found again by its spec's key (the one-call API's memory of recent calls, the XLA
handler's plans): two variants of an op that compile to different kernels, or take different
arguments, must never share a key, or a call would step another variant's plan."""
import itertools

import numpy as np
import pytest

from mtapply import AdamSpec, LAMBSpec, LARSSpec, SGDSpec
from mtapply import _optax_rules
from mtapply.rules import library


def _sgd_variants():
    for buffers, nesterov, maximize, master in itertools.product([False, True], repeat=4):
        if nesterov and not buffers:
            continue
        yield (f"sgd buffers={buffers} nesterov={nesterov} maximize={maximize} master={master}",
               SGDSpec(momentum_buffers=buffers, nesterov=nesterov, maximize=maximize,
                       master_weights=master))
    yield "sgd stochastic", SGDSpec(stochastic_rounding=True)


def _variants():
    yield from _sgd_variants()
    for adam_w_mode, nvlamb, master in itertools.product([False, True], repeat=3):
        yield (f"lamb adam_w_mode={adam_w_mode} nvlamb={nvlamb} master={master}",
               LAMBSpec(adam_w_mode=adam_w_mode, use_nvlamb=nvlamb, master_weights=master))
    for adam_w_mode, nvlamb in itertools.product([False, True], repeat=2):
        yield (f"optax lamb rule adam_w_mode={adam_w_mode} nvlamb={nvlamb}",
               _optax_rules.lamb(adam_w_mode, nvlamb).spec())
    yield "lars", LARSSpec()
    yield "lars master", LARSSpec(master_weights=True)
    yield "lars exclude", LARSSpec(exclude=[True, False, False])
    yield "optax lars rule", _optax_rules.lars().spec()
    for amsgrad, decoupled, maximize in itertools.product([False, True], repeat=3):
        yield (f"adam amsgrad={amsgrad} decoupled={decoupled} maximize={maximize}",
               AdamSpec(amsgrad=amsgrad, decoupled_weight_decay=decoupled, maximize=maximize))
    yield "lion", library.lion().spec()
    yield "lion 8-bit", library.lion().with_state_bits(8).spec()
    yield "sgd delta", SGDSpec().with_param_mode("delta")


VARIANTS = list(_variants())


def _what_a_plan_is(spec) -> tuple:
    return (getattr(spec, "functor_text", None), spec.kernel_file, spec.functor,
            tuple(spec.arg_fields), tuple(spec.slots), spec.flags,
            tuple(sorted((k, np.asarray(v).tobytes()) for k, v in spec.tensor_arrays(3).items())))


def test_variants_that_differ_never_share_a_call_key():
    by_key = {}
    for name, spec in VARIANTS:
        key = spec.call_key(3)
        if key in by_key:
            other_name, other = by_key[key]
            assert _what_a_plan_is(spec) == _what_a_plan_is(other), (
                f"{name} and {other_name} share the key {key} but differ")
        by_key[key] = (name, spec)
    # every SGD variant above compiles to a kernel of its own
    assert len({spec.call_key(3) for name, spec in VARIANTS if name.startswith("sgd")}) == \
        sum(1 for name, _ in VARIANTS if name.startswith("sgd"))


@pytest.mark.parametrize("make", [lambda **kw: SGDSpec(momentum_buffers=True, **kw),
                                  lambda **kw: LAMBSpec(**kw)], ids=["sgd", "lamb"])
def test_the_same_variant_made_twice_has_one_key(make):
    """(So the memory of recent calls finds a plan again: a key is not an identity.)"""
    assert make().call_key(4) == make().call_key(4)
    assert make(master_weights=True).call_key(4) == make(master_weights=True).call_key(4)
