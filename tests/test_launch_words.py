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
