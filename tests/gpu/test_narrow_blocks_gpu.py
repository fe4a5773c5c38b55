"""Blocks of one warp, or of 128 threads, over lists of small tensors
(mtapply._source.block_threads): every element of every tensor stepped once, on the vector path
and on the scalar path (views not 16-byte aligned), against the CPU path; per-tensor rows
checked on the device by a warp; passes that sum over a block keep whole blocks."""
import numpy as np
import pytest

import mtapply
from mtapply import _source

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def _lists(n_lists, sizes, dtype, seed, offset=0):
    """Tensors of these sizes; with offset 1 each is a view one element into its storage
    (not 16-byte aligned: the walker's scalar path)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_lists):
        column = []
        for n in sizes:
            x = torch.randn(n + offset, generator=g, dtype=torch.float64)
            x = x.abs() * 0.1 if k == 3 else x
            column.append(x.to("cuda", dtype)[offset:])
        out.append(column)
    return out


def _threads(plan):
    return {launch.threads for passes in plan._cuda.launches for launch in passes}


def _host(lists):
    return [[x.detach().float().cpu().numpy().copy() for x in column] for column in lists]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1])
def test_adam_over_small_tensors_in_warp_blocks_follows_the_cpu_path(dtype, offset):
    vec = 4 if dtype == torch.float32 else 8
    sizes = list(range(1, 32 * vec + 1)) * 3  # up to the largest chunk a warp takes
    gpu = _lists(4, sizes, dtype, 0, offset)
    cpu = _host(gpu)
    poisoned = [x.clone() for x in gpu[0]]
    plan = mtapply.adam_plan(*gpu)
    assert _threads(plan) == {32}
    for t in range(1, 4):
        plan.step(lr=5e-2, step=t, weight_decay=0.01)  # moves every bf16 value
        mtapply.adam_step(*cpu, lr=5e-2, step=t, weight_decay=0.01)
    torch.cuda.synchronize()
    rtol = 1e-5 if dtype == torch.float32 else 2e-2
    for i, (got, want, before) in enumerate(zip(gpu[0], cpu[0], poisoned)):
        got = got.float().cpu().numpy()
        assert not np.array_equal(got, before.float().cpu().numpy()), f"param {i} not stepped"
        if dtype == torch.bfloat16:  # the CPU path kept float32 params: round as the GPU stores
            want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
        np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6 if dtype == torch.float32 else 2e-2,
                                   err_msg=f"param {i} ({sizes[i]} elements)")
        assert got[0] == pytest.approx(want[0], rel=rtol, abs=1e-6 if rtol < 1e-3 else 2e-2)
        assert got[-1] == pytest.approx(want[-1], rel=rtol, abs=1e-6 if rtol < 1e-3 else 2e-2)


def test_one_tensor_past_a_warps_chunk_gives_the_launch_wider_blocks():
    more = torch.cuda.get_device_properties(0).multi_processor_count  # chunks than SMs
    lists = _lists(3, [100] * more + [129], torch.float32, 1)
    plan = mtapply.sgd_plan(*lists)
    assert _threads(plan) == {_source.NARROW_THREADS}
    assert _threads(mtapply.sgd_plan(*_lists(3, [100] * more, torch.float32, 1))) == {32}
    assert _threads(mtapply.sgd_plan(*_lists(3, [100] * 5 + [400_000], torch.float32, 1))) == {
        _source.BLOCK_THREADS}


def test_as_many_chunks_as_sms_get_whole_blocks():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gpu = _lists(3, [100] * (sms - 1) + [129], torch.float32, 2)  # mostly idle lanes
    cpu = _host(gpu)
    plan = mtapply.sgd_plan(*gpu)
    assert _threads(plan) == {_source.BLOCK_THREADS}
    for t in range(1, 3):
        plan.step(lr=0.1, step=t, momentum=0.9)
        mtapply.sgd_step(*cpu, lr=0.1, step=t, momentum=0.9)
    torch.cuda.synchronize()
    for got, want in zip(gpu[0] + gpu[2], cpu[0] + cpu[2]):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-6, atol=1e-7)


def _ragged(n, seed):
    """Sizes from a warp's chunk to a whole chunk: most chunks end part way through a stride."""
    return [int(x) for x in np.random.default_rng(seed).integers(129, 2 * _source.CHUNK_ELEMENTS, n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0, 1])
def test_adam_over_ragged_tensors_in_blocks_of_128_follows_the_cpu_path(dtype, offset):
    sizes = _ragged(300, 5)
    gpu = _lists(4, sizes, dtype, 6, offset)
    cpu = _host(gpu)
    poisoned = [x.clone() for x in gpu[0]]
    plan = mtapply.adam_plan(*gpu)
    assert _threads(plan) == {_source.NARROW_THREADS}
    for t in range(1, 4):
        plan.step(lr=5e-2, step=t, weight_decay=0.01)
        mtapply.adam_step(*cpu, lr=5e-2, step=t, weight_decay=0.01)
    torch.cuda.synchronize()
    rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (2e-2, 2e-2)
    for i, (got, want, before) in enumerate(zip(gpu[0], cpu[0], poisoned)):
        got = got.float().cpu().numpy()
        assert not np.array_equal(got, before.float().cpu().numpy()), f"param {i} not stepped"
        if dtype == torch.bfloat16:  # the CPU path kept float32 params: round as the GPU stores
            want = torch.from_numpy(want).to(torch.bfloat16).float().numpy()
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"param {i} ({sizes[i]} elements)")


def test_a_rule_over_ragged_tensors_in_blocks_of_128_follows_the_cpu_path():
    from mtapply.rules import library

    lion = library.lion()
    sizes = _ragged(200, 7)
    gpu = _lists(3, sizes, torch.float32, 8)
    cpu = _host(gpu)
    plan = lion.plan(*gpu)
    assert _threads(plan) == {_source.NARROW_THREADS}
    for _ in range(3):
        plan.step(lr=1e-2, weight_decay=0.1)
        lion.step(*cpu, lr=1e-2, weight_decay=0.1)
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(gpu[0], cpu[0])):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-6, atol=1e-7, err_msg=f"param {i}")


def test_per_tensor_rows_with_device_values_are_checked_by_a_warp():
    """Merged groups: 300 tensors, each its own row; the warp checks the rows 32 at a time, so a
    NaN lr in row 250 skips the whole step in every block (nothing written) and sets `invalid`."""
    sizes = [1 + i % 100 for i in range(300)]
    gpu = _lists(4, sizes, torch.float32, 2)
    cpu = _host(gpu)
    lr = [float(1e-3 * (1 + i % 7)) for i in range(300)]
    device_lr = torch.tensor(lr, device="cuda")
    plan = mtapply.adam_plan(*gpu)
    assert _threads(plan) == {32}
    plan.step(lr=[device_lr[i:i + 1] for i in range(300)], step=1, weight_decay=0.0)
    mtapply.adam_step(*cpu, lr=lr, step=1)
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(gpu[0], cpu[0])):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-5, atol=1e-7, err_msg=f"{i}")
    before = [[x.clone() for x in column] for column in gpu]
    device_lr[250] = float("nan")
    plan.step(lr=[device_lr[i:i + 1] for i in range(300)], step=2, weight_decay=0.0)
    torch.cuda.synchronize()
    for column, kept in zip(gpu, before):
        for got, want in zip(column, kept):
            assert torch.equal(got, want)
    assert plan.invalid.item() == 1.0


def test_lamb_over_small_tensors_keeps_whole_blocks_and_follows_the_cpu_path():
    sizes = [1 + i % 90 for i in range(200)]
    gpu = _lists(4, sizes, torch.float32, 3)
    cpu = _host(gpu)
    plan = mtapply.lamb_plan(*gpu)
    assert _threads(plan) == {_source.BLOCK_THREADS}  # its norms pass sums over the block
    for t in (1, 2):
        plan.step(lr=1e-2, step=t)
        mtapply.lamb_step(*cpu, lr=1e-2, step=t)
    torch.cuda.synchronize()
    for i, (got, want) in enumerate(zip(gpu[0], cpu[0])):
        np.testing.assert_allclose(got.cpu().numpy(), want, rtol=2e-5, atol=1e-6, err_msg=f"{i}")
