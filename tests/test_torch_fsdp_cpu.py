"""FSDP2 (DTensor) params on the CPU: a single-process gloo group, enough to shard a model."""
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import mtapply.torch as mt  # noqa: E402


@pytest.fixture
def sharded_model(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))  # not CUDA, where visible
        yield model
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("cls", [mt.LARS, mt.LAMB, mt.Prodigy, mt.DAdaptAdam])
def test_sums_over_shards_on_the_cpu_step_as_the_unsharded_model(cls, sharded_model):
    """The per-tensor norms of LARS and LAMB, and the whole-list sums of Prodigy and
    D-Adaptation, are taken over every tensor first, all-reduced over the shard group, then
    read by the update (one rank here: the same bits as the unsharded model)."""
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    plain.load_state_dict({k: v.full_tensor() for k, v in sharded_model.state_dict().items()})
    mine, theirs = cls(sharded_model.parameters(), lr=0.1), cls(plain.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        x = torch.randn(5, 4, generator=g)
        for model, opt in ((sharded_model, mine), (plain, theirs)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    hooked = [part for bound in mine._bound.values() for part in bound.parts]
    assert hooked and all(part.after_pass is not None for part in hooked)
    for p, q in zip(sharded_model.parameters(), plain.parameters()):
        assert torch.equal(p.detach().full_tensor(), q.detach())


def test_adamw_over_shards_on_the_cpu_steps_as_torch_optim(sharded_model):
    reference = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    reference.load_state_dict({k: v.full_tensor() for k, v in sharded_model.state_dict().items()})
    mine = mt.AdamW(sharded_model.parameters(), lr=1e-2)
    theirs = torch.optim.AdamW(reference.parameters(), lr=1e-2, foreach=False)
    for _ in range(3):
        x = torch.randn(5, 4)
        for model, opt in ((sharded_model, mine), (reference, theirs)):
            opt.zero_grad()
            model(x).square().sum().backward()
            opt.step()
    for p, q in zip(sharded_model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach())


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [mt.Prodigy, mt.DAdaptAdam])
def test_whole_list_sums_over_shards_on_a_gpu_step_as_the_unsharded_model(cls, tmp_path):
    """Prodigy's and D-Adaptation's whole-list sums over FSDP2 shards on a GPU: the first pass's
    sums are all-reduced over the shard group before the update (one rank here: the same bits
    as the unsharded model; tests/gpu/test_multi_gpu.py runs two ranks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(),
                                   torch.nn.Linear(30, 2)).cuda()

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        pytest.skip("needs a GPU and NCCL")
    dist.init_process_group("nccl", rank=0, world_size=1,
                            init_method=f"file://{tmp_path / 'store'}")
    try:
        sharded, plain = model(), model()
        fully_shard(sharded, mesh=init_device_mesh("cuda", (1,)))
        mine, theirs = cls(sharded.parameters(), lr=1.0), cls(plain.parameters(), lr=1.0)
        g = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(16, 40, generator=g).cuda()
            for net, opt in ((sharded, mine), (plain, theirs)):
                opt.zero_grad()
                net(x).square().sum().backward()
                opt.step()
        assert any(part.after_pass is not None for bound in mine._bound.values()
                   for part in bound.parts)
        for p, q in zip(sharded.parameters(), plain.parameters()):
            assert torch.equal(p.detach().full_tensor(), q.detach())
        assert float(next(iter(theirs.state.values()))["d"]) != 1e-6  # d grew
    finally:
        dist.destroy_process_group()
