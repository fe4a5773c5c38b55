"""mtapply.torch.Muon against torch.optim.Muon: the same arguments, checks, state and results
(to the tolerance of bfloat16 Newton-Schulz) over param groups, every option, schedulers and
checkpoints both ways; a bad group refused before any group moves; on a GPU, no host sync."""
import copy
import pickle
import warnings

import pytest

torch = pytest.importorskip("torch")
if not hasattr(torch.optim, "Muon"):
    pytest.skip("torch.optim.Muon needs torch 2.9+", allow_module_level=True)

import mtapply.torch as mt  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SHAPES = [(32, 64), (64, 32), (32, 64), (48, 48), (16, 80), (64, 32)]  # tall, wide, square
OPTIONS = [{}, dict(nesterov=False), dict(adjust_lr_fn="match_rms_adamw", weight_decay=0.01),
           dict(momentum=0.3, ns_steps=3, eps=1e-5), dict(adjust_lr_fn="original"),
           dict(ns_coefficients=(2.0, -1.5, 0.5), weight_decay=0.0)]


def _params(device, shapes=SHAPES, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(device)) for s in shapes]


def _set_grads(params, t):
    g = torch.Generator().manual_seed(100 + t)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.device)


def _train(opt, params, steps, first=0, scheduler=None):
    for t in range(first, first + steps):
        _set_grads(params, t)
        opt.step()
        if scheduler is not None:
            scheduler.step()


def _assert_close(a, b, lr=0.02):
    """A step moves a param by lr * ratio * O (|O| about 1): bfloat16 Newton-Schulz where the
    bfloat16 rounding of an update element went the other way differs by some 1% of a step.
    On a GPU the batched and the per-matrix products may also split their sums otherwise
    (cuBLAS, bfloat16): there each element within 10% of a step, their RMS within 1%."""
    for x, y in zip(a, b, strict=True):
        gpu = x.is_cuda
        x, y = x.detach().cpu(), y.detach().cpu()
        torch.testing.assert_close(x, y, rtol=0, atol=(0.1 if gpu else 0.02) * lr)
        assert (x - y).pow(2).mean().sqrt() <= 0.01 * lr


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in
                                                                    o.items()) or "defaults")
def test_muon_steps_as_torch_optim_muon(options, device):
    a, b = _params(device), _params(device)
    ours, theirs = mt.Muon(a, lr=0.02, **options), torch.optim.Muon(b, lr=0.02, **options)
    _train(ours, a, 6)
    _train(theirs, b, 6)
    _assert_close(a, b)
    for p, q in zip(a, b):
        torch.testing.assert_close(ours.state[p]["momentum_buffer"],
                                   theirs.state[q]["momentum_buffer"], rtol=1e-6, atol=1e-6)
    assert ours.state_dict()["param_groups"] == theirs.state_dict()["param_groups"]
    assert a[0].data_ptr() != 0 and not torch.equal(a[0], _params(device)[0])  # it moved


@pytest.mark.parametrize("device", DEVICES)
def test_param_groups_of_their_own_options_and_a_scheduler(device):
    def groups(params):
        return [{"params": params[:3], "lr": 0.05, "momentum": 0.9, "nesterov": False},
                {"params": params[3:], "adjust_lr_fn": "match_rms_adamw", "weight_decay": 0.2}]

    a, b = _params(device), _params(device)
    ours, theirs = mt.Muon(groups(a), lr=0.02), torch.optim.Muon(groups(b), lr=0.02)
    _train(ours, a, 5, scheduler=torch.optim.lr_scheduler.StepLR(ours, 2, gamma=0.5))
    _train(theirs, b, 5, scheduler=torch.optim.lr_scheduler.StepLR(theirs, 2, gamma=0.5))
    _assert_close(a, b, lr=0.05)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_move_both_ways(device):
    for first, second in ((mt.Muon, torch.optim.Muon), (torch.optim.Muon, mt.Muon)):
        a, b = _params(device), _params(device)
        before = first(a, lr=0.02)
        _train(before, a, 3)
        with torch.no_grad():
            for p, q in zip(a, b):
                q.copy_(p)
        after = second(b, lr=0.02)
        after.load_state_dict(pickle.loads(pickle.dumps(before.state_dict())))
        _train(before, a, 3, first=3)
        _train(after, b, 3, first=3)
        _assert_close(a, b)


def test_a_cpu_tensor_lr_and_copies():
    a, b = _params("cpu"), _params("cpu")
    ours = mt.Muon(a, lr=torch.tensor(0.02))
    theirs = torch.optim.Muon(b, lr=0.02)
    _train(ours, a, 2)
    _train(theirs, b, 2)
    _assert_close(a, b)
    twin = copy.deepcopy(ours)  # an independent copy: its state is its own
    assert twin.state_dict()["param_groups"][0]["lr"] == ours.param_groups[0]["lr"]
    clone = pickle.loads(pickle.dumps(ours))
    assert set(clone.state_dict()["state"]) == {0, 1, 2, 3, 4, 5}


def test_checks_as_torch_optim_muon():
    params = _params("cpu")
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        mt.Muon([torch.nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        mt.Muon(params, lr=torch.ones(2))
    for bad in (dict(lr=-1.0), dict(momentum=-0.1), dict(weight_decay=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            mt.Muon(params, **bad)
    with pytest.raises(ValueError, match="Adjust learning rate function"):
        mt.Muon(params, adjust_lr_fn="nope")
    with pytest.raises(ValueError, match="ns_steps must be a whole number below 100"):
        mt.Muon(params, ns_steps=100)
    with pytest.raises(ValueError, match="exactly 3 values"):
        mt.Muon(params, ns_coefficients=(1.0, 2.0))
    complex_matrix = torch.nn.Parameter(torch.ones(2, 2, dtype=torch.complex64))
    opt = mt.Muon([complex_matrix])  # refused at the step, as torch.optim.Muon
    complex_matrix.grad = torch.ones_like(complex_matrix)
    with pytest.raises(RuntimeError, match="does not support complex"):
        opt.step()


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_a_bad_group_is_refused_before_any_group_moves():
    params = _params("cpu")
    opt = mt.Muon([{"params": params[:3]}, {"params": params[3:]}], lr=0.02)
    _set_grads(params, 0)
    opt.param_groups[1]["ns_steps"] = 1.5  # edited after construction
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="param group 1: ns_steps"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before)) and not opt.state
    opt.param_groups[1]["ns_steps"] = 5
    params[4].grad = torch.sparse_coo_tensor([[0], [1]], [1.0], (16, 80))
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before)) and not opt.state


def test_params_without_grads_are_skipped_and_a_new_group_joins():
    a, b = _params("cpu"), _params("cpu")
    ours, theirs = mt.Muon(a[:4], lr=0.02), torch.optim.Muon(b[:4], lr=0.02)
    for opt, params in ((ours, a), (theirs, b)):
        _set_grads(params, 0)
        params[1].grad = None
        opt.step()
        opt.add_param_group({"params": params[4:], "lr": 0.01})
        _train(opt, params, 2, first=1)
    _assert_close(a, b)


@pytest.mark.gpu
def test_steps_on_the_gpu_wait_for_nothing_on_the_host():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    params = _params("cuda")
    opt = mt.Muon(params, lr=torch.tensor(0.02, device="cuda"))
    _train(opt, params, 2)  # compiles and binds
    _set_grads(params, 5)  # (the grads' host-to-device copies synchronise: before the check)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    reference = _params("cuda")
    theirs = torch.optim.Muon(reference, lr=0.02)
    for t in (0, 1, 5):
        _set_grads(reference, t)
        theirs.step()
    _assert_close(params, reference)


@pytest.mark.parametrize("device", DEVICES)
def test_the_hybrid_muon_and_adamw_groups_step_as_muon_and_adamw(device):
    """One optimizer, one step: Muon for the matrices, AdamW (torch.optim.AdamW's state and
    results) for the groups with use_muon=False, of any shape; a param that missed a step keeps
    its own step count, as torch.optim.AdamW's."""
    shapes = [(32, 64), (64, 32), (7,), (12, 5, 3), (32, 64)]

    def model():
        return _params(device, shapes, seed=3)

    a, b = model(), model()
    ours = mt.Muon([{"params": [a[0], a[1], a[4]]},
                    {"params": [a[2], a[3]], "use_muon": False, "lr": 3e-3,
                     "betas": (0.8, 0.99), "eps": 1e-8, "weight_decay": 0.01}], lr=0.02)
    muon = torch.optim.Muon([b[0], b[1], b[4]], lr=0.02)
    adamw = torch.optim.AdamW([b[2], b[3]], lr=3e-3, betas=(0.8, 0.99), eps=1e-8,
                              weight_decay=0.01)
    for t in range(5):
        for params, steps in ((a, (ours,)), (b, (muon, adamw))):
            _set_grads(params, t)
            if t == 2:
                params[3].grad = None
            for opt in steps:
                opt.step()
    _assert_close([a[0], a[1], a[4]], [b[0], b[1], b[4]])
    for p, q in ((a[2], b[2]), (a[3], b[3])):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        for name in ("step", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][name], adamw.state[q][name],
                                       rtol=1e-5, atol=1e-7)
    assert float(ours.state[a[3]]["step"]) == 4 and ours.param_groups[0].get("betas") is None


def test_hybrid_groups_are_checked_as_adamw():
    matrix, bias = torch.nn.Parameter(torch.ones(4, 4)), torch.nn.Parameter(torch.ones(4))
    with pytest.raises(ValueError, match="Muon only supports 2D parameters"):
        mt.Muon([{"params": [matrix]}, {"params": [bias]}])  # a 1-D param needs use_muon=False
    opt = mt.Muon([{"params": [matrix]}, {"params": [bias], "use_muon": False}])
    assert opt.param_groups[1]["betas"] == (0.9, 0.95)
    with pytest.raises(ValueError, match=r"betas\[1\]"):
        mt.Muon([{"params": [bias], "use_muon": False, "betas": (0.9, 1.0)}])
    with pytest.raises(TypeError, match="use_muon must be True or False"):
        mt.Muon([{"params": [matrix], "use_muon": 1}])
    for option in ("maximize", "amsgrad"):  # AdamW options its AdamW does not take
        with pytest.raises(ValueError, match=f"param group 2: {option}=True in a use_muon=False"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))],
                                 "use_muon": False, option: True})
        assert len(opt.param_groups) == 2  # the refused group is not kept
    opt.param_groups[1]["maximize"] = True  # set later: refused at the step, nothing written
    matrix.grad, bias.grad = torch.ones(4, 4), torch.ones(4)
    with pytest.raises(ValueError, match="param group 1: maximize=True"):
        opt.step()
    assert torch.equal(matrix, torch.ones(4, 4)) and torch.equal(bias, torch.ones(4))
    assert not opt.state


def test_the_benchmarks_rows_step_alike():
    """`python -m mtapply.bench --op muon` compares equal work: its torch rows (torch.optim.Muon,
    the same update batched by shape with torch.bmm) and mtapply's move the params alike."""
    from mtapply.bench import muon

    moved = {}
    for name in ("mtapply-torch", "torch", "torch-bmm"):
        data = muon.make_data([(32, 64), (64, 32), (48, 48), (32, 64)], "cpu", 0)
        stepper = muon.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        moved[name] = [p.detach().clone() for p in data.params]
    _assert_close(moved["mtapply-torch"], moved["torch"])
    _assert_close(moved["torch-bmm"], moved["torch"])
    assert not torch.equal(moved["torch"][0], muon.make_data([(32, 64)], "cpu", 0).params[0])


@pytest.mark.gpu
def test_a_step_captured_in_a_cuda_graph_replays_as_eager_steps():
    """Warm-up steps on a side stream, a capture, then replays: the params move as eager steps
    on the same grads do (the plans, batches and norms' blocks stay where the graph saw them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    graphed, eager = _params("cuda"), _params("cuda")
    ours, reference = mt.Muon(graphed, lr=0.02), mt.Muon(eager, lr=0.02)
    _set_grads(graphed, 0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            ours.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ours.step()
    for _ in range(3):
        graph.replay()
    _set_grads(eager, 0)
    for _ in range(5):  # 2 warm-up steps and 3 replays (a capture runs nothing)
        reference.step()
    torch.cuda.synchronize()
    _assert_close(graphed, eager)  # (cuBLAS may pick other algorithms under capture)


@pytest.mark.parametrize("state_bits", [32, 16, 8])
def test_sharded_matrices_step_as_whole_ones(state_bits):
    """FSDP2 (DTensor) params, Muon's matrices and the AdamW group's vectors alike, step as the
    same params whole, to the bit (one rank: the gathered matrix is the shard), their state
    kept as DTensors sharded as the params."""
    from _one_rank import one_rank_mesh

    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    shapes = [(64, 96), (64, 96), (96, 64), (300,)]
    with one_rank_mesh() as mesh:
        whole = _params("cpu", shapes=shapes)
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)]))
                   for p in whole]

        def make(params):
            return mt.Muon([{"params": params[:3]}, {"params": params[3:], "use_muon": False}],
                           lr=0.02, state_bits=state_bits, min_8bit_size=256)

        ours, theirs = make(sharded), make(whole)
        for t in range(3):
            _set_grads(whole, t)
            for p, q in zip(sharded, whole):
                p.grad = distribute_tensor(q.grad.clone(), mesh, [Shard(0)])
            ours.step()
            theirs.step()
        for k, (p, q) in enumerate(zip(sharded, whole)):
            assert torch.equal(p.full_tensor(), q), f"params[{k}]"
            for name, value in ours.state[p].items():
                if name != "step":
                    assert isinstance(value, DTensor), name
                    want = theirs.state[q][name]  # (8-bit scales: a row per shard)
                    assert torch.equal(value.full_tensor().reshape(want.shape), want), name


def test_what_the_kernels_would_refuse_is_refused_before_any_group_moves():
    """A strided (not dense) matrix, a state set to another layout: refused at the step's
    checks, before the AdamW group ahead of them moves (a transposed matrix, or a grad of
    another layout, steps: test_transposed_matrices_step_as_torch_optim_muon_steps_them)."""
    def fresh():
        bias, matrix = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(6, 4))
        opt = mt.Muon([{"params": [bias], "use_muon": False}, {"params": [matrix]}], lr=0.02)
        bias.grad, matrix.grad = torch.randn(5), torch.randn(6, 4)
        return opt, bias, matrix

    opt, bias, matrix = fresh()
    strided = torch.nn.Parameter(torch.randn(6, 8)[:, ::2])
    strided.grad = torch.randn(6, 8)[:, ::2]
    opt.add_param_group({"params": [strided]})
    before = bias.detach().clone()
    with pytest.raises(ValueError, match="param group 2: param 0 has strides .* contiguous"):
        opt.step()
    assert torch.equal(bias, before) and not opt.state

    opt, bias, matrix = fresh()
    opt.step()
    opt.state[matrix]["momentum_buffer"] = torch.zeros(4, 6).t()
    before = bias.detach().clone()
    with pytest.raises(ValueError, match="state 'momentum_buffer' is .* strides"):
        opt.step()
    assert torch.equal(bias, before)


def test_the_heavyball_row_moves_the_params_as_far_as_torch_optim_muon():
    """HeavyBall's Muon (a bench row where it is installed) is not the same update, but with the
    bench's settings each matrix moves about as far as torch.optim.Muon moves it (heavyball
    3.2.1: 16-18% further in 3 steps), so the row times real steps. (Its step sets the grads to
    None; a row that did not attach them again would time no-ops, which moved a third as far.)"""
    pytest.importorskip("heavyball")
    from mtapply.bench import muon

    start = muon.make_data([(32, 64), (64, 32), (48, 48)], "cpu", 0).params
    moved = {}
    for name in ("heavyball", "torch"):
        data = muon.make_data([(32, 64), (64, 32), (48, 48)], "cpu", 0)
        stepper = muon.COMPETITORS[name].build(data)
        for _ in range(3):
            stepper.step()
        moved[name] = [float((p.detach() - s).norm()) for p, s in zip(data.params, start)]
    assert moved["heavyball"] == pytest.approx(moved["torch"], rel=0.25), moved


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6, 96, 160), (6, 160, 96), (3, 64, 64)])
def test_the_newton_schulz_update_product_equals_baddbmm(shape):
    """The X update a X + B X (wide) or a X + X B (tall) by one cuBLASLt product, whose input
    is not its output, gives what torch.baddbmm gives, and leaves its inputs as they were."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mtapply._lt_products import LtProducts

    count, rows, cols = shape
    side = min(rows, cols)
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)
    b = torch.randn((count, side, side), generator=g, device="cuda").to(torch.bfloat16)
    out = torch.full_like(x, float("nan"))
    before = (x.clone(), b.clone())
    stream = torch.cuda.current_stream().cuda_stream
    if rows <= cols:
        LtProducts(count, rows, side, cols, x.device)(b, x, x, out, 1.0, 3.4, stream)
        expected = torch.baddbmm(x, b, x, beta=3.4)
    else:
        LtProducts(count, rows, side, side, x.device)(x, b, x, out, 1.0, 3.4, stream)
        expected = torch.baddbmm(x, x, b, beta=3.4)
    gap = (out.float() - expected.float()).norm() / expected.float().norm()
    assert gap < 1e-3, f"relative gap {gap:.2e}"
    assert torch.equal(x, before[0]) and torch.equal(b, before[1])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(6, 96, 160), (6, 160, 96), (3, 64, 64)])
def test_the_gram_polynomial_product_equals_baddbmm(shape):
    """b G + c G G by one cuBLASLt product into a buffer other than G gives what torch.baddbmm
    gives, and leaves G as it was."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from mtapply.torch_muon import _Batch, _Grams

    count, rows, cols = shape
    params = [torch.empty((rows, cols), device="cuda") for _ in range(count)]
    batch = _Batch(params)
    _Grams.join([batch])
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(batch.gram.shape, generator=g, device="cuda")
    batch.gram.copy_(x + x.mT)
    batch.gram_update.fill_(float("nan"))
    before = batch.gram.clone()
    batch.gram_polynomial(-4.775, 2.0315)
    assert batch.grams.lt, "the CUDA batch runs cuBLASLt's products"
    expected = torch.baddbmm(before, before, before, beta=-4.775, alpha=2.0315)
    gap = (batch.gram_update.float() - expected.float()).norm() / expected.float().norm()
    assert gap < 1e-3, f"relative gap {gap:.2e}"
    assert torch.equal(batch.gram, before)


def _newton_schulz_batches(device, groups):
    """A `_Batch` per (count, rows, cols), its Newton-Schulz start a seeded randn of unit norm."""
    from mtapply.torch_muon import _Batch

    g = torch.Generator().manual_seed(11)
    batches = []
    for count, rows, cols in groups:
        batch = _Batch([torch.empty((rows, cols), device=device) for _ in range(count)])
        x = torch.randn(batch.other.shape, generator=g)
        batch.other.copy_(x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True))
        batches.append(batch)
    return batches


@pytest.mark.parametrize("device", DEVICES)
def test_one_gram_polynomial_over_every_batch_of_a_side_gives_the_per_batch_results(device):
    """Batches of one short side share one buffer of Gram matrices and one b G + c G G per
    iteration: each matrix's result is the one its batch gives alone (bit for bit on the CPU;
    on a GPU the products of another batch count may split their sums otherwise)."""
    from mtapply.torch_muon import NS_COEFFICIENTS, newton_schulz

    groups = [(2, 8, 24), (1, 24, 8), (1, 8, 8), (3, 16, 48), (2, 40, 16), (2, 32, 64)]
    joined = _newton_schulz_batches(device, groups)
    done = newton_schulz(joined, NS_COEFFICIENTS, 5)
    side8, side16, side32 = joined[:3], joined[3:5], joined[5]
    assert side8[0].grams is side8[1].grams is side8[2].grams
    assert side8[0].grams.gram.shape == (4, 8, 8) and side16[0].grams.gram.shape == (5, 16, 16)
    assert side32.grams.gram.shape[0] == side32.count and side32.grams.batches == (side32,)
    for batch, alone in zip(joined, _newton_schulz_batches(device, groups)):
        expected = newton_schulz([alone], NS_COEFFICIENTS, 5)[id(alone)]
        assert alone.grams.gram.shape[0] == alone.count  # its own
        for got, want in zip(done[id(batch)], expected, strict=True):
            if device == "cpu":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)


@pytest.mark.parametrize("device", DEVICES)
def test_a_side_joined_again_when_its_batches_change(device):
    """A step without some matrices' grads leaves their batches out of their side's shared
    Gram matrices (the side's first batch too), the next step takes them back: each step as
    torch.optim.Muon's."""
    shapes = [(8, 24), (24, 8), (8, 8), (8, 24), (16, 8)]
    a, b = _params(device, shapes), _params(device, shapes)
    ours, theirs = mt.Muon(a, lr=0.02), torch.optim.Muon(b, lr=0.02)
    for t, left_out in enumerate(((), (0, 3), (), (2,), (1,), ())):
        for params, opt in ((a, ours), (b, theirs)):
            _set_grads(params, t)
            for k in left_out:
                params[k].grad = None
            opt.step()
        _assert_close(a, b)
    side8 = [batch for batch in ours._batches.values() if batch.side == 8]
    assert len(side8) == 4 and side8[0].grams.batches == tuple(side8)
    assert all(batch.grams is side8[0].grams for batch in side8)


@pytest.mark.parametrize("device", DEVICES)
def test_each_matrix_is_divided_by_its_norm_as_torch_optim_muon_divides_it(device):
    """Newton-Schulz's start, one launch over every batch: torch.optim.Muon's bfloat16
    X / max(||X||, eps), the norm rounded to bfloat16, bit for bit; eps where the norm is less;
    all NaN where the matrix holds a NaN."""
    from mtapply.rules import library

    g = torch.Generator().manual_seed(8)
    shapes = [(40, 24), (24, 40), (7, 5), (1, 1), (6, 4), (3, 2)]
    xs = [(torch.randn(s, generator=g) * 10 ** k).to(device, torch.bfloat16)
          for k, s in enumerate(shapes)]
    xs[-2][2, 3] = float("nan")
    xs[-1].mul_(1e-13)  # its norm (some 1e-9) is below eps
    out = [torch.full_like(x, float("nan")) for x in xs]
    library.muon_normalize().step(out, xs, eps=1e-7)
    assert xs[-1].float().norm() < 1e-7
    for x, got in zip(xs, out):
        want = x / x.norm().clamp(min=1e-7)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert out[-2].isnan().all()


def test_float64_params_step_without_numpys_warnings_whatever_the_freed_memory_held():
    # the batch's bfloat16 buffers are made where NaN bits were just freed: the CPU backend
    # reads them before the momentum pass writes them, and NumPy warned on casting NaNs
    for _ in range(5):
        junk = torch.full((4, 129, 37), float("nan"), dtype=torch.bfloat16)
        del junk
        params = [torch.nn.Parameter(torch.randn(129, 37, dtype=torch.float64)) for _ in range(4)]
        opt = mt.Muon(params)
        for p in params:
            p.grad = torch.randn_like(p)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            opt.step()
        assert all(torch.isfinite(p).all() for p in params)


@pytest.mark.parametrize("device", DEVICES)
def test_grads_of_other_strides_step_as_torch_optim_muon_steps_them(device):
    # a transposed grad of a contiguous param (torch.optim.Muon takes any layout), then a
    # checkpoint of torch's, whose buffers lie as those grads did, loaded and stepped on
    a, b = _params(device), _params(device)
    ours, theirs = mt.Muon(a, lr=0.02), torch.optim.Muon(b, lr=0.02)
    for t in range(4):
        g = torch.Generator().manual_seed(200 + t)
        for p, q in zip(a, b):
            grad = torch.randn(p.shape[::-1], generator=g).to(device).t()
            p.grad, q.grad = grad.clone().t().contiguous().t(), grad
            assert p.grad.stride() != p.stride()
        ours.step()
        theirs.step()
    _assert_close(a, b)
    for p, q in zip(a, b):
        torch.testing.assert_close(ours.state[p]["momentum_buffer"],
                                   theirs.state[q]["momentum_buffer"], rtol=1e-6, atol=1e-6)
    loaded = mt.Muon(a, lr=0.02)
    loaded.load_state_dict(copy.deepcopy(theirs.state_dict()))  # (a load shares the tensors)
    for p, q in zip(a, b):
        p.grad = torch.ones_like(p).t().contiguous().t()
        q.grad = p.grad.clone()
    loaded.step()
    theirs.step()
    _assert_close(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_transposed_matrices_step_as_torch_optim_muon_steps_them(device, adjust_lr_fn):
    # column-major (transposed) matrices, tall and wide, beside row-major ones of their
    # transposes' shapes (one batch each), their grads laid out as the params or not
    def made():
        g = torch.Generator().manual_seed(7)
        shapes = [(32, 64), (64, 32), (48, 16)]
        rows = [torch.randn(s, generator=g) for s in shapes]
        cols = [torch.randn(s, generator=g).t() for s in shapes]
        return [torch.nn.Parameter(x.to(device)) for x in rows + cols]

    a, b = made(), made()
    assert [p.is_contiguous() for p in a] == [True] * 3 + [False] * 3
    ours = mt.Muon(a, lr=0.02, adjust_lr_fn=adjust_lr_fn)
    theirs = torch.optim.Muon(b, lr=0.02, adjust_lr_fn=adjust_lr_fn)
    for t in range(6):
        g = torch.Generator().manual_seed(300 + t)
        for p, q in zip(a, b):
            grad = torch.randn(p.shape, generator=g).to(device)
            if t % 2:
                grad = torch.empty_like(p).copy_(grad)  # the param's layout
            p.grad, q.grad = grad.clone(), grad
        ours.step()
        theirs.step()
    _assert_close(a, b)
    assert [p.stride() for p in a] == [q.stride() for q in b]
    for p, q in zip(a, b):
        torch.testing.assert_close(ours.state[p]["momentum_buffer"],
                                   theirs.state[q]["momentum_buffer"], rtol=1e-6, atol=1e-6)
    twin = made()
    loaded = mt.Muon(twin, lr=0.02, adjust_lr_fn=adjust_lr_fn)
    loaded.load_state_dict(copy.deepcopy(theirs.state_dict()))  # (a load shares the tensors)
    g = torch.Generator().manual_seed(400)
    for p, q, r in zip(twin, b, a):
        with torch.no_grad():
            p.copy_(q)
            r.copy_(q)
        p.grad = torch.randn(p.shape, generator=g).to(device)
        q.grad, r.grad = p.grad.clone(), p.grad.clone()
    loaded.step()
    theirs.step()
    ours.step()
    _assert_close(twin, b)
    _assert_close(a, twin)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("state_bits", [32, 16, 8])
def test_a_transposed_matrix_steps_bit_for_bit_as_its_row_major_transpose(device, state_bits):
    # the same memory, the same batch and the same passes (match_rms_adamw's lr does not
    # depend on which side is the longer)
    g = torch.Generator().manual_seed(11)
    made = [torch.randn(64, 96, generator=g).to(device) for _ in range(2)]
    column_major = [torch.nn.Parameter(x.t()) for x in made]  # (96, 64), strides (1, 96)
    row_major = [torch.nn.Parameter(x.clone()) for x in made]  # (64, 96)
    options = dict(lr=0.02, adjust_lr_fn="match_rms_adamw", state_bits=state_bits,
                   min_8bit_size=16)
    ours, twin = mt.Muon(column_major, **options), mt.Muon(row_major, **options)
    for t in range(3):
        for p, q in zip(column_major, row_major):
            q.grad = torch.randn(q.shape, generator=g).to(device)
            p.grad = q.grad.t()
        ours.step()
        twin.step()
    for p, q in zip(column_major, row_major):
        assert torch.equal(p.t(), q)


def test_bfloat16_params_without_nesterov_keep_the_documented_momentum_buffer():
    """B_t = lerp(B_t-1, g_t, 1 - momentum), as torch.optim.Muon documents it, with bfloat16
    params and nesterov=False too. (torch 2.13's own step divides that buffer by its norm in
    place there: its Newton-Schulz starts from grad.bfloat16(), the buffer itself.)"""
    g = torch.Generator().manual_seed(7)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in SHAPES[:3]]
    opt = mt.Muon(params, lr=0.02, momentum=0.9, nesterov=False)
    expected = [torch.zeros_like(p) for p in params]
    for _ in range(3):
        for p, buf in zip(params, expected):
            p.grad = torch.randn(p.shape, generator=g).bfloat16()
            buf.lerp_(p.grad, 1 - 0.9)
        opt.step()
    for p, buf in zip(params, expected):
        got = opt.state[p]["momentum_buffer"]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, buf)
