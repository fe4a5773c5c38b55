"""The benchmark's rule rows (Lion, Adam written as a rule) step the same data as their peers
on the CPU, so the rows it times compute the same update (its GPU, JAX and graph rows run
only in the benchmark)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mtapply.bench import lion  # noqa: E402


def test_lion_competitors_agree_on_the_cpu():
    shapes = [(10,), (3, 4), (0,), (257,)]
    results = {}
    for name in ("mtapply", "mtapply-torch", "torch-loop", "torch-foreach"):
        data = lion.make_data(shapes, torch.device("cpu"), seed=0)
        stepper = lion.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        results[name] = [t.detach().clone() for t in data.params + data.exp_avgs]
    for name, tensors in results.items():
        for got, want in zip(tensors, results["torch-loop"]):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)


def test_lion8bit_rows_step_one_8_bit_update_and_follow_fp32_lion_on_the_cpu():
    from mtapply.bench import lion8bit

    shapes = [(10,), (5000,), (0,), (4097,)]
    results = {}
    for name in ("mtapply", "mtapply-torch", "mtapply-fp32"):
        data = lion8bit.make_data(shapes, torch.device("cpu"), seed=0)
        stepper = lion8bit.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        results[name] = [t.detach().clone() for t in data.params]
    for got, want in zip(results["mtapply-torch"], results["mtapply"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(results["mtapply"], results["mtapply-fp32"]):  # signs of 8-bit moments
        assert got.numel() == 0 or (got != want).float().mean() < 0.02


def test_clipped_adamw_rows_step_alike_on_the_cpu():
    from mtapply.bench import clipped

    shapes = [(10,), (3, 4), (0,), (257,)]
    results = {}
    for name in ("mtapply", "mtapply-torch", "torch-clip-fused"):
        data = clipped.make_data(shapes, torch.device("cpu"), seed=0)
        stepper = clipped.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        results[name] = [t.detach().clone() for t in data.params]
    for got, want in zip(results["mtapply-torch"], results["mtapply"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(results["mtapply"], results["torch-clip-fused"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_prodigy_rows_step_alike_on_the_cpu():
    from mtapply.bench import prodigy

    shapes = [(10,), (3, 4), (0,), (257,)]
    results = {}
    names = ["mtapply", "mtapply-torch"]
    try:
        import prodigyopt  # noqa: F401
        names.append("prodigyopt")
    except ImportError:
        pass
    for name in names:
        data = prodigy.make_data(shapes, torch.device("cpu"), seed=0)
        stepper = prodigy.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        results[name] = [t.detach().clone() for t in data.params]
    for name in names[1:]:
        for got, want in zip(results[name], results["mtapply"]):
            torch.testing.assert_close(got, want, rtol=2e-5, atol=1e-6, msg=name)


def test_adam_rule_row_steps_like_the_built_in_row():
    from mtapply.bench import adam

    shapes = [(10,), (3, 4), (0,), (257,)]
    results = {}
    for name in ("mtapply", "mtapply-rule"):
        data = adam.make_data(shapes, torch.device("cpu"), 0)
        stepper = adam.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        results[name] = data.params + data.exp_avgs + data.exp_avg_sqs
    for got, want in zip(results["mtapply-rule"], results["mtapply"]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_per_tensor_group_rows_step_alike_on_the_cpu():
    """The bench's many-groups op: mtapply.torch.AdamW with a group per tensor, with and without
    flat grads, against torch.optim.AdamW on the same groups and data."""
    from mtapply.bench import adam_groups

    shapes = [(10,), (3, 4), (257,), (5, 6)]
    results = {}
    for name in ("mtapply-torch", "mtapply-torch-flat", "torch-foreach"):
        data = adam_groups.make_data(shapes, torch.device("cpu"), 0)
        stepper = adam_groups.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        results[name] = [t.detach().clone() for t in data.params]
    assert not torch.equal(results["torch-foreach"][0], adam_groups.make_data(
        shapes, torch.device("cpu"), 0).params[0])
    for name, tensors in results.items():
        for got, want in zip(tensors, results["torch-foreach"]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_per_tensor_group_labels_in_jax_step_as_the_groups(monkeypatch):
    """The same op's JAX rows (optax.multi_transform of optax's or mtapply's adamws, and
    mtapply.optax.multi_transform), on the CPU: the labels give each tensor its group's lr and
    weight decay, as torch.optim.AdamW's groups do."""
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    import jax

    from mtapply.bench import adam_groups

    monkeypatch.setattr(adam_groups, "jax_lists", lambda lists: [
        [jax.device_put(t.cpu().numpy(), jax.devices("cpu")[0]) for t in tensors]
        for tensors in lists])
    from mtapply.bench.common import attach_grads

    shapes = [(10,), (3, 4), (257,), (5, 6), (7,), (2, 2)]
    data = adam_groups.make_data(shapes, torch.device("cpu"), 0)
    attach_grads(data.params, data.grads)
    opt = torch.optim.AdamW(adam_groups.groups(data.params), foreach=True)  # zero moments
    for _ in range(3):
        opt.step()
    for name in ("optax-labels", "mtapply-optax-labels", "mtapply-optax-labels-fused",
                 "mtapply-optax-per-label"):
        stepper = adam_groups.COMPETITORS[name].build(adam_groups.make_data(
            shapes, torch.device("cpu"), 0))  # one step taken, as the first call's time
        loop = stepper.keep_alive[0]
        for _ in range(2):
            stepper.step()
        for got, want in zip(loop.params, data.params):
            torch.testing.assert_close(torch.from_numpy(np.asarray(got)), want.detach(),
                                       rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("name", ["rmsprop8bit", "adagrad8bit", "sgd8bit", "ademamix8bit"])
def test_8_bit_twin_rows_keep_8_bit_state_and_follow_their_float_rows_on_the_cpu(name):
    from mtapply.bench.ops import OPS

    op = OPS[name]
    shapes = [(10,), (5000,), (0,), (4097,)]
    results, notes = {}, {}
    for competitor in ("mtapply", "mtapply-fp32"):
        data = op.make_data(shapes, torch.device("cpu"), seed=0)
        start = [p.detach().clone() for p in data.params]
        stepper = op.COMPETITORS[competitor].build(data)
        for _ in range(3):
            stepper.step()
        results[competitor] = [(p.detach() - s) for p, s in zip(data.params, start)]
        notes[competitor] = stepper.note
    for k, (got, want) in enumerate(zip(results["mtapply"], results["mtapply-fp32"])):
        if want.numel():  # (a second moment's smallest codes move single elements more)
            assert want.abs().mean() > 0
            assert (got - want).abs().mean() <= 0.05 * want.abs().mean(), f"{name} params[{k}]"
    slots = op.BYTES_PER_PARAM - 12 >> 1
    eight = float(notes["mtapply"].split()[1])  # about a byte per slot and element
    assert slots * 0.95 < eight < slots * 1.1, notes["mtapply"]
    assert float(notes["mtapply-fp32"].split()[1]) > 3.9 * slots
