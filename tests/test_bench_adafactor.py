"""The benchmark's Adafactor op on the CPU, on tiny workloads: it is listed, its torch rows
(mtapply.torch.Adafactor, torch.optim.Adafactor with and without foreach) step alike, its JAX
rows (optax.adafactor, mtapply.optax.adafactor and its fused form, optax's update) step
alike, and each row notes its state's bytes per param."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mtapply.bench import adafactor  # noqa: E402
from mtapply.bench.ops import OPS  # noqa: E402
from mtapply.bench.workloads import WORKLOADS  # noqa: E402

# factored by both (a matrix of at least 128 x 128), by torch only (below optax's 128), not
SHAPES = [(160, 130), (6, 40), (7,), (130, 3, 128)]


def test_the_op_and_its_workloads_are_listed():
    assert OPS["adafactor"] is adafactor
    assert set(adafactor.DEFAULT_WORKLOADS) <= set(WORKLOADS)
    assert set(adafactor.TARGETS) == set(adafactor.DEFAULT_WORKLOADS)


def test_state_is_about_a_hundredth_of_a_byte_per_param_on_gpt2():
    assert 0.009 < adafactor.state_bytes_per_param(WORKLOADS["gpt2-124M"]()) < 0.012
    assert adafactor.state_bytes_per_param([(7,)]) == 4.0
    # torch factors the last two dimensions, optax the two largest
    assert adafactor.state_bytes_per_param([(4, 8, 2)]) == 4 * (32 + 8) / 64
    assert adafactor.state_bytes_per_param([(4, 8, 2)], min_dim=1) == 4 * (16 + 8) / 64


def test_torch_rows_step_alike():
    results = {}
    for name in ("mtapply", "torch-foreach", "torch-loop"):
        data = adafactor.make_data(SHAPES, torch.device("cpu"), seed=0)
        start = [p.detach().clone() for p in data.params]
        stepper = adafactor.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        assert stepper.note.startswith("state ")
        results[name] = [p.detach().clone() for p in data.params]
    assert not torch.equal(results["torch-loop"][0], start[0])
    for name, tensors in results.items():
        for got, want in zip(tensors, results["torch-loop"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_jax_rows_step_alike(monkeypatch):
    jax = pytest.importorskip("jax")
    pytest.importorskip("optax")
    monkeypatch.setattr(adafactor, "jax_lists", lambda lists: [
        [jax.device_put(t.cpu().numpy(), jax.devices("cpu")[0]) for t in tensors]
        for tensors in lists])
    results = {}
    for name in ("optax-adafactor", "mtapply-optax", "mtapply-optax-flat", "mtapply-optax-fused"):
        data = adafactor.make_data(SHAPES, torch.device("cpu"), seed=0)
        stepper = adafactor.COMPETITORS[name].build(data)  # one step taken, as the first call's
        for _ in range(2):
            stepper.step()
        stepper.sync()
        results[name] = [np.asarray(p) for p in stepper.keep_alive[0].params]
    start = adafactor.make_data(SHAPES, torch.device("cpu"), seed=0).params[0].numpy()
    assert not np.array_equal(results["optax-adafactor"][0], start)
    for name in ("mtapply-optax", "mtapply-optax-flat", "mtapply-optax-fused"):
        for got, want in zip(results[name], results["optax-adafactor"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
