"""The launch words the host packs (mtapply._launch.KernelLaunch), read back without a GPU."""
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from mtapply._launch import _HEADER, HEADER_BYTES, KernelLaunch

FIELDS = ("lr", "lr_ptr", "step", "weight_decay")
FLAG = 0xABC0


def header_words(launch: KernelLaunch) -> tuple:
    return struct.unpack(_HEADER, launch.words()[:HEADER_BYTES])


def flag_word(launch: KernelLaunch) -> int:
    return header_words(launch)[-1]  # the `invalid` flag is the header's last word


def launch_with_flag() -> KernelLaunch:
    launch = KernelLaunch(SimpleNamespace(ptr=0), 256, 1, FIELDS)
    launch.set_invalid(FLAG)
    return launch


def host_args(**changes) -> dict:
    return {"lr": 0.1, "step": 3.0, "weight_decay": 0.01, **changes}


def test_host_numbers_alone_leave_the_kernel_nothing_to_check():
    launch = launch_with_flag()
    launch.set_args(host_args())
    assert flag_word(launch) == 0
    op_words = np.frombuffer(launch.words()[HEADER_BYTES:], np.float64)
    assert op_words[0] == 0.1 and op_words[2] == 3.0 and op_words[3] == 0.01


@pytest.mark.parametrize("device_value", ["lr", "grad_scale", "step_counter", "rows"])
def test_a_device_value_gives_the_kernel_the_flag(device_value):
    launch = launch_with_flag()
    scalar = SimpleNamespace(ptr=0x5000)
    args, grad_scale = host_args(), 1.0
    if device_value == "lr":
        args["lr"] = scalar
    elif device_value == "grad_scale":
        grad_scale = scalar
    elif device_value == "step_counter":
        launch.set_counting(0x6000, 0x7000, 4)
    else:
        launch.set_rows(0x8000, 0x9000, checked_rows=2)
    launch.set_args(args, grad_scale)
    assert flag_word(launch) == FLAG
    if device_value == "lr":  # a device scalar is NaN plus its address
        lr, lr_ptr = np.frombuffer(launch.words()[HEADER_BYTES:HEADER_BYTES + 16], np.uint64)
        assert np.isnan(np.uint64(lr).view(np.float64)) and lr_ptr == 0x5000


def test_rows_the_host_checked_leave_the_flag_out():
    launch = launch_with_flag()
    launch.set_rows(0x8000, 0x9000, checked_rows=0)
    launch.set_args(host_args())
    assert flag_word(launch) == 0


def _scheduled_specs():
    """Ops whose repeated steps may rewrite only the lr and step words, each with the numbers
    its `arguments` takes besides them."""
    from mtapply.lamb import LAMBSpec
    from mtapply.lars import LARSSpec
    from mtapply.ops import Adam8bitSpec, AdamSpec
    from mtapply.rules import library
    from mtapply.sgd import SGDSpec

    return [
        pytest.param(AdamSpec(decoupled_weight_decay=True), dict(weight_decay=0.01), id="adamw"),
        pytest.param(Adam8bitSpec(), dict(beta1=0.8), id="adam8bit"),
        pytest.param(SGDSpec(nesterov=True), dict(momentum=0.9), id="sgd-nesterov"),
        pytest.param(LARSSpec(), dict(momentum=0.9, weight_decay=1e-4), id="lars"),
        pytest.param(LAMBSpec(), dict(weight_decay=0.01), id="lamb"),
        pytest.param(library.lion().spec(), dict(weight_decay=0.1), id="lion"),
        pytest.param(library.nadam().spec(), {}, id="nadam-scalar-state"),
        pytest.param(library.lion().with_state_bits(8).spec(), {}, id="lion-8bit"),
        pytest.param(library.adam().spec(stochastic_rounding=True), dict(seed=7), id="adam-rounded"),
    ]


def _launch(spec) -> KernelLaunch:
    launch = KernelLaunch(SimpleNamespace(ptr=0), 256, 1, spec.arg_fields)
    for k, field in enumerate(f for f in spec.arg_fields if f.endswith("_array")):
        launch.set_array(field, 0x1000 + k)  # per-tensor arrays: some device address each
    return launch


def _words(spec, **hyper) -> bytes:
    launch = _launch(spec)
    launch.set_args(spec.arguments(**hyper))
    return launch.words()


@pytest.mark.parametrize("spec,others", _scheduled_specs())
def test_a_new_lr_or_step_rewrites_exactly_the_words_arguments_would(spec, others):
    """A repeated step with a new lr or step count packs those numbers alone into the latest
    step's words (mtapply._repeat): the words must equal those `arguments` gives. LARS reads no
    step: a new one goes through `arguments`."""
    from mtapply._repeat import _scheduled_words

    outputs = {name: SimpleNamespace(ptr=0x2000) for name in getattr(spec, "outputs", ())}
    launch = _launch(spec)
    current = dict(lr=0.25, step=3, **others, **outputs)
    launch.set_args(spec.arguments(**current))
    steps = spec.scheduled_word("step") is not None
    assert steps == (spec.name != "lars")
    for changed in ({"step": 4}, {"lr": 0.125}, {"lr": 0.5, "step": 9}):
        words = _scheduled_words(spec, changed)
        if "step" in changed and not steps:
            assert words is None
            changed = {"lr": changed["lr"]} if "lr" in changed else {}
            words = _scheduled_words(spec, changed)
        for field, value in words:
            launch.set_number(field, value)
        current.update(changed)
        assert launch.words() == _words(spec, **current), changed
    assert _scheduled_words(spec, {"beta2": 0.99}) is None


@pytest.mark.parametrize("changed,message", [({"lr": -1.0}, "lr must be"),
                                             ({"step": 0.5}, "step must be"),
                                             ({"lr": float("nan")}, "lr must be")])
def test_a_scheduled_value_out_of_range_is_refused_before_any_word_changes(changed, message):
    from mtapply._repeat import _scheduled_words
    from mtapply.ops import AdamSpec

    with pytest.raises(ValueError, match=message):
        _scheduled_words(AdamSpec(), changed)
