"""Tensor makers and comparisons shared by the GPU tests."""
from __future__ import annotations

import numpy as np

import mtapply

TOL = {"float32": (1.3e-6, 1e-5), "float64": (1e-7, 1e-7), "float16": (1e-3, 1e-5),
       "bfloat16": (1.6e-2, 1e-5)}


def torch_dtype(name):
    import torch

    return getattr(torch, name)


def adam_state(shapes, dtype="float32", device="cuda", seed=0, state_dtype=None):
    """Random (never zero) params, grads and Adam states as torch tensors."""
    import torch

    g = torch.Generator(device=device).manual_seed(seed)
    dt, st = torch_dtype(dtype), torch_dtype(state_dtype or dtype)
    make = lambda s, d, scale=1.0, shift=0.0: (torch.randn(s, generator=g, device=device,  # noqa: E731
                                                           dtype=torch.float32) * scale + shift).to(d)
    params = [make(s, dt) for s in shapes]
    grads = [make(s, dt) for s in shapes]
    exp_avgs = [make(s, st, 0.1) for s in shapes]
    exp_avg_sqs = [make(s, st, 0.01).abs() for s in shapes]
    max_sqs = [make(s, st, 0.01).abs() for s in shapes]
    return params, grads, exp_avgs, exp_avg_sqs, max_sqs


def to64(t) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def reference_step(params, grads, exp_avgs, exp_avg_sqs, max_sqs, **kw):
    """float64 reference of one step from the tensors' current values (as float64 arrays)."""
    out = []
    for i in range(len(params)):
        res = mtapply.reference.adam(to64(params[i]), to64(grads[i]), to64(exp_avgs[i]),
                                     to64(exp_avg_sqs[i]), to64(max_sqs[i]) if max_sqs else None, **kw)
        out.append(res)
    return out


def assert_matches(tensor, expected: np.ndarray, dtype: str, where: str, scale: float = 1.0):
    rtol, atol = TOL[dtype]
    got = to64(tensor)
    np.testing.assert_allclose(got, expected.reshape(got.shape), rtol=rtol * scale,
                               atol=atol * scale, err_msg=where)


def on_gpu_at(arrays, offset=0):
    """NumPy arrays as torch tensors on the GPU; with offset 1 each a view one element into its
    storage (not 16-byte aligned: the kernels' element-by-element paths)."""
    import torch

    out = []
    for a in arrays:
        flat = np.concatenate([np.zeros(offset, a.dtype), a.reshape(-1)])
        out.append(torch.from_numpy(flat).cuda()[offset:].view(a.shape))
    return out


def count_launches(fn) -> int:
    """The kernel launches mtapply issues while `fn()` runs."""
    launches = []
    original = mtapply._launch.KernelLaunch.launch
    mtapply._launch.KernelLaunch.launch = lambda self, s: (launches.append(s), original(self, s))[1]
    try:
        fn()
    finally:
        mtapply._launch.KernelLaunch.launch = original
    return len(launches)
