"""mtapply.optax over two devices on the CPU: jax.pmap, jax.jit of params sharded by
NamedSharding, and jax.shard_map each equal the same steps on one device. The checks are the
functions of tests/gpu/test_optax_multi_gpu.py (which run them on two GPUs), run here on two
host devices in a fresh interpreter (the device count is fixed when jax starts)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")
ROOT = Path(__file__).resolve().parents[1]

CODE = """
import itertools, sys
import jax, pytest
import test_optax_multi_gpu as t
devices = jax.devices("cpu")[:2]
assert len(devices) == 2
test = getattr(t, sys.argv[1])
axes = [[(m.args[0], value) for value in m.args[1]] for m in test.pytestmark
        if m.name == "parametrize"]
ran = 0
for case in itertools.product(*axes):
    kwargs = dict(case)
    try:
        test(devices, **kwargs)
        ran += 1
    except pytest.skip.Exception:
        pass
    except Exception:
        print("FAILED", kwargs, flush=True)
        raise
print("ran", ran)
"""


@pytest.mark.parametrize("test", ["test_pmap_replicas_equal_their_steps_on_one_gpu",
                                  "test_jit_of_sharded_params_equals_one_gpu",
                                  "test_shard_map_steps_each_shard_on_its_device"])
def test_two_cpu_devices_equal_one_device(test):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "gpu"),
                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", CODE, test], env=env, timeout=900,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert int(out.stdout.split("ran")[-1]) > 0
