"""mtapply.torch in the training loops of its clients, on the CPU: a torch.compile'd whole
training step (flat_grads on and off), and GradScaler's unscale_ -> clip_grad_norm_ -> step
sequence, which Lightning's 16-mixed runs whenever gradient_clip_val is set."""
import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _model(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4)).to(device)


def _batches(n, device="cpu"):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 8, generator=g).to(device),
             torch.randint(0, 4, (16,), generator=g).to(device)) for _ in range(n)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("flat_grads", [False, True])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_compiled_training_step_matches_eager(flat_grads, set_to_none, device):
    eager, compiled_model = _model(device), _model(device)
    opts = [mt.AdamW(m.parameters(), lr=1e-2, flat_grads=flat_grads)
            for m in (eager, compiled_model)]

    def train_step(model, opt, x, y):
        opt.zero_grad(set_to_none=set_to_none)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss

    compiled = torch.compile(train_step, backend="aot_eager")
    for x, y in _batches(4, device):
        train_step(eager, opts[0], x, y)
        compiled(compiled_model, opts[1], x, y)
    for p, q in zip(eager.parameters(), compiled_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)  # the compiled forward may round
    assert float(opts[1].state[compiled_model[0].weight]["step"]) == 4.0


def _lightning_16_mixed_step(model, opt, scaler, x, y, clip):
    """What Lightning's precision plugin for 16-mixed does around a step with
    gradient_clip_val: unscale first unless the optimizer says its step unscales (then it
    refuses to clip), clip, and let the scaler step and update."""
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    if getattr(opt, "_step_supports_amp_scaling", False):
        raise RuntimeError("the optimizer unscales in its step: no gradient clipping")
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_unscale_clip_step_as_lightning_runs_it(device):
    ours, theirs = _model(device), _model(device)
    opt = mt.AdamW(ours.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(theirs.parameters(), lr=1e-2, foreach=False)
    seen = []  # what GradScaler.step gave the step: no scale (unscaled already), its inf flag
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(
        (o.__dict__.get("grad_scale"), o.__dict__.get("found_inf"))))
    scalers = [torch.amp.GradScaler(device, init_scale=2.0 ** 12) for _ in range(2)]
    batches = _batches(6, device)
    batches[3] = (batches[3][0] * float("inf"), batches[3][1])  # an overflow: a skipped step
    for x, y in batches:
        for model, o, scaler in ((ours, opt, scalers[0]), (theirs, ref, scalers[1])):
            _lightning_16_mixed_step(model, o, scaler, x, y, clip=0.5)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert [scale for scale, _ in seen] == [None] * 6
    assert [float(found) for _, found in seen] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert float(opt.state[ours[0].weight]["step"]) == 5.0  # the overflow's step skipped
    assert scalers[0].get_scale() == scalers[1].get_scale()


def test_grad_scaler_alone_hands_its_scale_to_the_step():
    """Without unscale_, GradScaler.step passes its scale and inf flag: the step unscales
    (kernels read both on the device) and matches torch.optim behind the same scaler."""
    ours, theirs = _model(), _model()
    opt = mt.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.9, foreach=False)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(o.__dict__.get("grad_scale")))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 10) for _ in range(2)]
    for x, y in _batches(4):
        for model, o, scaler in ((ours, opt, scalers[0]), (theirs, ref, scalers[1])):
            o.zero_grad()
            scaler.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            scaler.step(o)
            scaler.update()
    assert all(float(scale) == 2.0 ** 10 for scale in seen)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert mt.SGD._step_supports_amp_scaling is True  # as the class declares it
