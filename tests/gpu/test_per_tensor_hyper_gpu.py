"""Per-tensor hyperparameters on the GPU: one launch per group of dtypes reads each tensor's
row of args; against the CPU path with the same per-tensor values (which equals each tensor's
own step), for Adam, AdamW, SGD, 8-bit AdamW, LARS and LAMB, with values changing between
steps, a tensor changing rows, and device-scalar steps in a CUDA graph."""
import numpy as np
import pytest

import mtapply

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

SHAPES = [(1 << 20 | 3,), (3, 5), (4096,), (0,), (300,), (9000,)]


def _lists(seed, n_lists, device):
    g = torch.Generator().manual_seed(seed)
    made = [[torch.randn(s, generator=g) * (0.1 if k >= 2 else 1.0) for s in SHAPES]
            for k in range(n_lists)]
    if n_lists == 4:
        made[3] = [x.abs() for x in made[3]]
    return [[x.to(device) for x in column] for column in made]


def _assert_close(gpu, cpu):
    for a, b in zip(sum(gpu, []), sum(cpu, [])):
        a = a.cpu()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        if a.numel():
            assert torch.isclose(a.reshape(-1)[-1], b.reshape(-1)[-1], rtol=1e-5, atol=1e-6)


def test_adamw_rows_follow_the_cpu_path_and_change_between_steps():
    gpu, cpu = _lists(0, 4, "cuda"), _lists(0, 4, "cpu")
    before = gpu[0][0].clone()
    for t in range(1, 5):
        lr = [1e-3 / t, 2e-3, 1e-3, 1e-3, 5e-4 * t, 2e-3]
        weight_decay = [0.0, 0.01, 0.01, 0.0, 0.0 if t < 3 else 0.1, 0.1]  # a tensor changes row
        for lists in (gpu, cpu):
            mtapply.adam_step(*lists, lr=lr, step=t, weight_decay=weight_decay,
                              decoupled_weight_decay=True, beta1=[0.9, 0.8] * 3)
    torch.cuda.synchronize()
    assert not torch.equal(gpu[0][0], before)
    _assert_close(gpu, cpu)


def test_lars_and_lamb_rows_follow_the_cpu_path():
    """Two passes: the norms of each tensor, then its update with its own row."""
    lars_gpu, lars_cpu = _lists(7, 3, "cuda"), _lists(7, 3, "cpu")
    lamb_gpu, lamb_cpu = _lists(8, 4, "cuda"), _lists(8, 4, "cpu")
    exclude = [False, True, False, False, True, False]
    norm = torch.full((1,), 1.5, device="cuda")
    lars_plan = mtapply.lars_plan(*lars_gpu, exclude=exclude)
    lamb_plan = mtapply.lamb_plan(*lamb_gpu)
    for t in (1, 2, 3):
        lr = [0.1 / t, 0.2, 0.05, 0.1, 0.3, 0.1]
        decay = [0.0, 1e-2, 1e-2, 0.0, 1e-3, 1e-2]
        clip = [0.0, 1.0, 0.5, 0.0, 2.0, 1.0]
        lars_plan.step(lr=lr, weight_decay=decay, momentum=0.9)
        mtapply.lars_step(*lars_cpu, lr=lr, weight_decay=decay, momentum=0.9, exclude=exclude)
        lamb_plan.step(lr=lr, step=t, weight_decay=decay, max_grad_norm=clip,
                       global_grad_norm=norm)
        mtapply.lamb_step(*lamb_cpu, lr=lr, step=t, weight_decay=decay, max_grad_norm=clip,
                          global_grad_norm=1.5)
    torch.cuda.synchronize()
    _assert_close(lars_gpu, lars_cpu)
    _assert_close(lamb_gpu, lamb_cpu)


def test_sgd_and_adam8bit_rows():
    gpu, cpu = _lists(1, 3, "cuda"), _lists(1, 3, "cpu")
    for t in (1, 2, 3):
        for lists in (gpu, cpu):
            mtapply.sgd_step(*lists, lr=[0.1, 0.01, 0.1, 0.1, 0.05, 0.1], step=t,
                             momentum=[0.9, 0.0, 0.5, 0.9, 0.9, 0.0])
    torch.cuda.synchronize()
    _assert_close(gpu, cpu)
    rng = np.random.default_rng(2)
    params = [rng.standard_normal(s).astype(np.float32) for s in [(5000,), (12,), (70000,)]]
    grads = [rng.standard_normal(p.shape).astype(np.float32) for p in params]
    state = mtapply.adam8bit_state(params)
    gpu_params = [torch.from_numpy(p.copy()).cuda() for p in params]
    gpu_state = [[torch.from_numpy(x.copy()).cuda() for x in column] for column in state.lists()]
    lr = [1e-3, 3e-3, 2e-3]
    mtapply.adam8bit_step(gpu_params, [torch.from_numpy(g).cuda() for g in grads], *gpu_state,
                          lr=lr, step=1)
    mtapply.adam8bit_step(params, grads, *state.lists(), lr=lr, step=1)
    torch.cuda.synchronize()
    for a, b in zip(gpu_params, params):
        np.testing.assert_allclose(a.cpu().numpy(), b, rtol=1e-5, atol=1e-6)


def test_rows_with_a_device_step_replay_in_a_cuda_graph():
    gpu, cpu = _lists(3, 4, "cuda"), _lists(3, 4, "cpu")
    plan = mtapply.adam_plan(*gpu)
    step = torch.ones(1, device="cuda")
    lr = [1e-3, 2e-3, 3e-3, 1e-3, 2e-3, 3e-3]
    plan.step(lr=lr, step=step)  # the rows are uploaded outside the capture
    mtapply.adam_step(*cpu, lr=lr, step=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.step(lr=lr, step=step)
    for t in (2, 3):
        step.fill_(t)
        graph.replay()
        mtapply.adam_step(*cpu, lr=lr, step=t)
    torch.cuda.synchronize()
    _assert_close(gpu, cpu)


def test_rows_patched_for_new_lrs_then_found_again_when_they_split():
    """lrs that change every step within the same rows are patched into the device rows (the
    plan keeps their origin); rows that split are packed again; both against the CPU path."""
    gpu, cpu = _lists(4, 4, "cuda"), _lists(4, 4, "cpu")
    plan = mtapply.adam_plan(*gpu, decoupled_weight_decay=True)
    weight_decay = (0.0, 0.1, 0.1, 0.0, 0.1, 0.0)
    lrs = [(1e-3, 1e-3, 2e-3, 1e-3, 2e-3, 1e-3), (8e-4, 8e-4, 3e-3, 8e-4, 3e-3, 8e-4),
           (5e-4, 5e-4, 1e-3, 5e-4, 1e-3, 5e-4), (5e-4, 5e-4, 1e-3, 6e-4, 1e-3, 5e-4),
           (4e-4, 7e-4, 2e-3, 4e-4, 2e-3, 4e-4)]
    origins = []
    for t, lr in enumerate(lrs, start=1):
        plan.step(lr=lr, step=t, weight_decay=weight_decay)
        origins.append(plan._latest_rows.origin)
        mtapply.adam_step(*cpu, lr=lr, step=t, weight_decay=weight_decay,
                          decoupled_weight_decay=True)
    torch.cuda.synchronize()
    assert origins[0] is origins[1] is origins[2]  # patched
    assert origins[3] is not origins[2] and origins[4] is origins[3]  # split, then patched
    _assert_close(gpu, cpu)


def test_scheduled_lrs_reach_the_rows_through_their_slots():
    """Per-tensor lrs that change every step, one value still per row, are written into the
    rows' float32 slots: the plan repeats its launches and the rows' words stay, over two
    launch groups (float32 and float16). An array changed in place is seen; rows that split
    are packed again; against the CPU path."""
    gpu, cpu = _lists(6, 4, "cuda"), _lists(6, 4, "cpu")
    for lists in (gpu, cpu):
        for column in lists:
            column[4], column[5] = column[4].half(), column[5].half()
    plan = mtapply.adam_plan(*gpu, decoupled_weight_decay=True)
    weight_decay = (0.0, 0.1, 0.1, 0.0, 0.1, 0.0)
    lr = np.array([1e-3, 1e-3, 2e-3, 1e-3, 2e-3, 1e-3])
    repeats, words = [], []
    for t in range(1, 6):
        if t == 4:
            lr[3] = 7e-4  # tensor 3 leaves its row
        else:
            lr *= 0.8  # in place: the same array object every step
        plan.step(lr=lr, step=t, weight_decay=weight_decay)
        mtapply.adam_step(*cpu, lr=lr.copy(), step=t, weight_decay=weight_decay,
                          decoupled_weight_decay=True)
        repeats.append(plan._repeat)
        words.append([held.words.copy() for held in plan._cuda._rows._tables.values()])
    torch.cuda.synchronize()
    assert len(words[0]) == 2 and repeats[0] is not None
    assert repeats[0] is repeats[1] is repeats[2]  # new lrs, same launches
    assert all(np.array_equal(a, b) for a, b in zip(words[0], words[2]))
    assert repeats[3] is not repeats[2] and repeats[4] is repeats[3]  # split, then slotted
    for a, b in zip(sum(gpu, []), sum(cpu, [])):
        tol = 2e-3 if a.dtype == torch.float16 else 1e-5
        torch.testing.assert_close(a.cpu(), b, rtol=tol, atol=tol / 10)


def test_float64_rows_keep_scheduled_values_in_double():
    """float64 params read their rows' lrs in double (not from float32 slots), patched in
    place when they change: the CPU path's float64 result within float64 rounding."""
    gpu, cpu = _lists(7, 4, "cuda"), _lists(7, 4, "cpu")
    gpu = [[x.double() for x in column] for column in gpu]
    cpu = [[x.double() for x in column] for column in cpu]
    plan = mtapply.adam_plan(*gpu)
    for t in range(1, 5):
        lr = tuple(v / t for v in (1.1e-3, 2.3e-3, 1.1e-3, 3.7e-3, 2.3e-3, 1.1e-3))
        plan.step(lr=lr, step=t, beta1=(0.9, 0.8) * 3)
        mtapply.adam_step(*cpu, lr=lr, step=t, beta1=(0.9, 0.8) * 3)
    torch.cuda.synchronize()
    assert not plan._cuda._rows.slots.names or not any(plan._cuda._slotted)
    for a, b in zip(sum(gpu, []), sum(cpu, [])):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-13)


def test_slot_writes_do_not_wait_for_a_busy_gpu():
    """New lrs written while the GPU is still busy with earlier work take more staging buffers
    rather than waiting for the copies in flight; the steps still follow the CPU path."""
    gpu, cpu = _lists(8, 4, "cuda"), _lists(8, 4, "cpu")
    plan = mtapply.adam_plan(*gpu)
    lrs = [tuple(1e-3 * (1 + k % 2) / t for k in range(len(SHAPES))) for t in range(1, 8)]
    plan.step(lr=lrs[0], step=1)
    mtapply.adam_step(*cpu, lr=lrs[0], step=1)
    torch.cuda._sleep(200_000_000)  # a tenth of a second or more of GPU time, queued first
    for t in range(2, 8):
        plan.step(lr=lrs[t - 1], step=t)
        mtapply.adam_step(*cpu, lr=lrs[t - 1], step=t)
    grown = len(plan._cuda._rows.slots.table._staging)
    torch.cuda.synchronize()
    assert grown > 2
    _assert_close(gpu, cpu)


def test_merged_groups_follow_a_scheduler_on_the_gpu(monkeypatch):
    """mtapply.torch with a group per tensor and flat_grads, lrs set by a scheduler every step
    and betas changed once, against torch.optim.AdamW."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(5)]).cuda()
    twin = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(5)]).cuda()
    twin.load_state_dict(model.state_dict())

    def groups(m):
        return [{"params": [p], "lr": 1e-2 / (1 + k), "weight_decay": 0.01 * (k % 2)}
                for k, p in enumerate(m.parameters())]

    import mtapply.torch as mt
    from mtapply import _torch_binding

    repeated = []  # whether each step repeated the latest (with new lrs: in its slots)
    original = _torch_binding.LatestStep.repeat
    monkeypatch.setattr(_torch_binding.LatestStep, "repeat",
                        lambda self, opt: repeated.append(original(self, opt)) or repeated[-1])
    ours = mt.AdamW(groups(model), flat_grads=True)
    theirs = torch.optim.AdamW(groups(twin), foreach=False)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda t: 0.9 ** t) for o in (ours, theirs)]
    for t in range(6):
        x = torch.randn(4, 16, device="cuda")
        for m, opt, scheduler in ((model, ours, schedulers[0]), (twin, theirs, schedulers[1])):
            if t == 3:
                opt.param_groups[2]["betas"] = (0.5, 0.9)
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
            scheduler.step()
    assert list(ours._bound) == ["merged"]
    assert repeated == [True, False, True, True]  # from the third step; betas change steps anew
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_merged_groups_keep_number_lrs_in_device_slots():
    """A scheduler's lrs are written to one float32 slot per group: the plan's rows stay the
    same objects; a bad lr names its group before anything is written; float64 params keep
    their lrs in double, in the rows."""
    import mtapply.torch as mt

    torch.manual_seed(6)
    for dtype in (torch.float32, torch.float64):
        model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(3)]).to("cuda", dtype)
        groups = [{"params": [p], "lr": 1e-2 / (1 + k)} for k, p in enumerate(model.parameters())]
        opt = mt.AdamW(groups, flat_grads=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
        rows = []
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(2, 8, device="cuda", dtype=dtype)).square().mean().backward()
            opt.step()
            stepped = [g["lr"] for g in opt.param_groups]  # the lrs this step read
            scheduler.step()
            (part,) = opt._bound["merged"].parts
            rows.append(part.plan._latest_rows)
        if dtype == torch.float64:
            assert part.lrs is None
            continue
        assert all(r is rows[0] for r in rows)  # new lrs went to the slots alone
        torch.cuda.synchronize()
        import cupy

        table = part.lrs.values.table
        memory = cupy.cuda.UnownedMemory(table.ptr, table.nbytes, table)
        slots = cupy.ndarray((len(groups),), cupy.float32, cupy.cuda.MemoryPointer(memory, 0))
        np.testing.assert_array_equal(slots.get(), np.float32(stepped))
        before = [p.detach().clone() for p in model.parameters()]
        opt.param_groups[3]["lr"] = -1.0
        opt.zero_grad()
        model(torch.randn(2, 8, device="cuda")).square().mean().backward()
        with pytest.raises(ValueError, match=r"param group 3: lr must be >= 0, got -1.0"):
            opt.step()
        torch.cuda.synchronize()
        assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
