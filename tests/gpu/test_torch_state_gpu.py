"""mtapply.torch optimizers' state on the GPU: the saved `step` where torch.optim keeps it, a
CPU-saved state loaded onto CUDA params, and copies and loads repeated under memory reuse
(a copy or a load never leaves a plan on freed memory). The device-independent behaviours are
in tests/test_torch_state.py, which also runs them on CUDA."""
import copy
import gc

import pytest

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mtapply.torch")
from test_torch_state import (CASE_IDS, COUNTING_CASES, NAMES, _make, _params,  # noqa: E402
                              _run, _set_grads)

TORCH = {"Adam": (torch.optim.Adam, mt.Adam), "AdamW": (torch.optim.AdamW, mt.AdamW),
         "Adagrad": (torch.optim.Adagrad, mt.Adagrad), "RMSprop": (torch.optim.RMSprop, mt.RMSprop),
         "SGD": (torch.optim.SGD, mt.SGD)}


@pytest.mark.parametrize("name,options", [
    ("Adam", {}), ("Adam", dict(fused=True)), ("Adam", dict(capturable=True)),
    ("AdamW", dict(fused=True)), ("AdamW", dict(capturable=True)), ("Adagrad", dict(fused=True)),
    ("RMSprop", dict(capturable=True)), ("RMSprop", {})])
def test_the_saved_step_is_where_torch_keeps_it(name, options):
    if name == "Adagrad" and tuple(map(int, torch.__version__.split(".")[:2])) < (2, 12):
        pytest.skip("torch.optim.Adagrad(fused=True) takes CUDA params from torch 2.12 on")
    saved = []
    for cls in TORCH[name]:
        params = _params(device="cuda")
        opt = cls(params, lr=1e-2, **options)
        _run(params, opt, 0, 3)
        saved.append(opt.state_dict())
    for ours, theirs in zip(saved[1]["state"].values(), saved[0]["state"].values()):
        assert ours["step"].device == theirs["step"].device
        assert ours["step"].dtype == theirs["step"].dtype and float(ours["step"]) == 3.0


@pytest.mark.parametrize("impl", ["fused", "capturable"])
@pytest.mark.parametrize("name", ["Adam", "AdamW", "RMSprop", "Adagrad"])
def test_a_cpu_saved_fused_state_loads_onto_the_params_device(name, impl):
    if impl == "fused" and name == "RMSprop" or impl == "capturable" and name == "Adagrad":
        pytest.skip("torch.optim has no such variant")
    params = _params()
    opt = TORCH[name][1](params, lr=1e-2)
    _run(params, opt, 0, 2)
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0][impl] = True  # as a fused optimizer's checkpoint read on the CPU
    cuda_params = [torch.nn.Parameter(p.detach().cuda()) for p in params]
    cuda_opt = TORCH[name][1](cuda_params, lr=1e-2, **{impl: True})
    cuda_opt.load_state_dict(saved)
    for p in cuda_params:
        for key, value in cuda_opt.state[p].items():
            assert value.device == p.device, key
    _run(params, opt, 2, 5)
    _run(cuda_params, cuda_opt, 2, 5)
    for p, q in zip(params, cuda_params):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in NAMES if n != "GaLoreAdamW"])  # (SVDs differ)
def test_a_cpu_saved_state_continues_on_cuda_params(name):
    params = _params()
    opt = _make(name, params)
    _run(params, opt, 0, 3)
    cuda_params = [torch.nn.Parameter(p.detach().cuda()) for p in params]
    cuda_opt = _make(name, cuda_params)
    cuda_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p in cuda_params:
        for key, value in cuda_opt.state[p].items():
            if isinstance(value, torch.Tensor) and key != "step":
                assert value.device == p.device, key
    _run(params, opt, 3, 6)
    _run(cuda_params, cuda_opt, 3, 6)
    # 8-bit moments: CPU and GPU may round a moment to the neighbouring code (0.2 lr apart)
    atol = 2e-3 if "8bit" in name else 1e-5
    for p, q in zip(params, cuda_params):
        torch.testing.assert_close(q.cpu(), p, rtol=1e-4, atol=atol)


@pytest.mark.parametrize("name,flat", COUNTING_CASES, ids=CASE_IDS)
def test_copies_and_loads_under_memory_reuse_step_as_one_uninterrupted_run(name, flat):
    """Rounds of: step, deepcopy, load the copy's state_dict back, drop the copy and return
    its memory to the allocator; each round synchronised, so a launch on freed memory would
    fault here and not in a later test. The result is that of an uninterrupted run."""
    params, reference_params = _params(device="cuda"), _params(device="cuda")
    opt, reference = _make(name, params, flat), _make(name, reference_params, flat)
    for t in range(8):
        for ps, o in ((params, opt), (reference_params, reference)):
            _set_grads(ps, t, o)
            o.step()
        copied = copy.deepcopy(opt)
        opt.load_state_dict(copy.deepcopy(copied.state_dict()))
        del copied
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
    for p, q in zip(params, reference_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
