"""mtapply.optax over several devices on the CPU: jax.pmap over two host devices (each replica
one buffer callback) equals the same steps on one device. The GPU twin of this check is
tests/gpu/test_optax_multi_gpu.py, which runs the same function on two GPUs."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
ROOT = Path(__file__).resolve().parents[1]

CODE = """
import jax
import test_optax_multi_gpu as t
for form in ("fused", "transformation"):
    for rule in ("adamw", "lamb"):
        t.test_pmap_replicas_equal_their_steps_on_one_gpu(jax.devices("cpu")[:2], form, rule)
"""


def test_pmap_over_two_cpu_devices_equals_one_device():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "gpu"),
                                          os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", CODE], check=True, env=env, timeout=600)
