"""The ops under test, one row each, plus dtype-tied tolerances and array helpers.

Adding an optimizer to the common tests means adding one row to `OPS`: its spec class, the flag
combinations to sweep, hyperparameter sets, a float64 reference in slot-dict form, how to draw
its state, its torch.optim counterpart, and its out-of-range hyperparameters.
"""
from __future__ import annotations

import itertools

import numpy as np

import mtapply
from mtapply import reference
from mtapply.lamb import LAMBSpec
from mtapply.lars import LARSSpec
from mtapply.ops import AdamSpec
from mtapply.sgd import SGDSpec

# (rtol, atol) per storage dtype: the defaults of torch.testing.assert_close.
TOLERANCES = {
    "float32": (1.3e-6, 1e-5),
    "float16": (1e-3, 1e-5),
    "bfloat16": (1.6e-2, 1e-5),
    "float64": (1e-7, 1e-7),
}
NUMPY_DTYPES = ("float32", "float64", "float16")  # NumPy has no bfloat16: those tests use torch


# ---------------------------------------------------------------------------------------------
# Adam


def _adam_reference(arrays: dict, *, flags: dict, hyper: dict, step) -> dict:
    """New values of Adam's written slots, in float64, from float64 inputs."""
    p, m, v, vmax = reference.adam(
        arrays["params"], arrays["grads"], arrays["exp_avgs"], arrays["exp_avg_sqs"],
        arrays.get("max_exp_avg_sqs"), step=step, **hyper, **flags)
    out = {"params": p, "exp_avgs": m, "exp_avg_sqs": v}
    if flags.get("amsgrad"):
        out["max_exp_avg_sqs"] = vmax
    return out


def _adam_state(slot: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """A plausible non-zero state: exp_avg any sign, second moments non-negative."""
    if slot == "exp_avgs":
        return 0.1 * rng.standard_normal(shape)
    if slot == "exp_avg_sqs":
        return 0.01 * rng.standard_normal(shape) ** 2
    if slot == "max_exp_avg_sqs":
        return 0.02 * rng.standard_normal(shape) ** 2
    raise KeyError(slot)


def _adam_torch(params: list, *, flags: dict, hyper: dict):
    """torch.optim.Adam, or AdamW when decoupled, single-tensor (foreach=False) implementation."""
    import torch

    cls = torch.optim.AdamW if flags["decoupled_weight_decay"] else torch.optim.Adam
    return cls(params, lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
               weight_decay=hyper["weight_decay"], amsgrad=flags["amsgrad"],
               maximize=flags["maximize"], foreach=False)


_ADAM_FLAGS = [dict(amsgrad=a, decoupled_weight_decay=d, maximize=m)
               for a, d, m in itertools.product((False, True), repeat=3)]
_ADAM_BASE = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
_ADAM_HYPER = [
    dict(_ADAM_BASE),
    dict(_ADAM_BASE, weight_decay=0.1),
    # beta1 < 0.5 takes the other branch of torch's two-sided lerp
    dict(_ADAM_BASE, beta1=0.3, beta2=0.95, weight_decay=0.1),
    dict(_ADAM_BASE, beta1=0.0, beta2=0.0),  # the edges of [0, 1)
]
_ADAM_BAD_HYPER = [
    (dict(beta1=1.0), ValueError, r"beta1 must be \[0\.0, 1\.0\)"),
    (dict(beta1=-0.1), ValueError, r"beta1"),
    (dict(beta2=1.0), ValueError, r"beta2"),
    (dict(beta2=1.5), ValueError, r"beta2"),
    (dict(beta2=float("nan")), ValueError, r"beta2"),
    (dict(lr=-1e-3), ValueError, r"lr must be >= 0, got"),
    (dict(lr=float("nan")), ValueError, r"lr .*nan"),
    (dict(lr=np.float32(-1e-3)), ValueError, r"lr"),
    (dict(lr=None), TypeError, r"lr must be a Python number"),
    (dict(lr="1e-3"), TypeError, r"lr"),
    (dict(eps=-1e-8), ValueError, r"eps"),
    (dict(weight_decay=-0.1), ValueError, r"weight_decay"),
    (dict(step=0), ValueError, r"step must be a whole number >= 1"),
    (dict(step=np.int64(0)), ValueError, r"step"),
    (dict(step=-3), ValueError, r"step"),
    (dict(step=float("nan")), ValueError, r"step"),
    (dict(beta1=True), TypeError, r"beta1"),
]

# ---------------------------------------------------------------------------------------------
# SGD


def _sgd_reference(arrays: dict, *, flags: dict, hyper: dict, step) -> dict:
    """New values of SGD's written slots, in float64, from float64 inputs."""
    p, buf = reference.sgd(arrays["params"], arrays["grads"], arrays.get("momentum_buffers"),
                           step=step, **hyper, nesterov=flags["nesterov"], maximize=flags["maximize"])
    out = {"params": p}
    if "momentum_buffers" in arrays:
        out["momentum_buffers"] = arrays["momentum_buffers"] if buf is None else buf
    return out


def _sgd_state(slot: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """Momentum buffers hold garbage before step 1, which must overwrite them."""
    if slot == "momentum_buffers":
        return rng.standard_normal(shape)
    raise KeyError(slot)


def _sgd_torch(params: list, *, flags: dict, hyper: dict):
    """torch.optim.SGD, single-tensor (foreach=False) implementation."""
    import torch

    return torch.optim.SGD(params, lr=hyper["lr"], momentum=hyper["momentum"],
                           dampening=hyper["dampening"], weight_decay=hyper["weight_decay"],
                           nesterov=flags["nesterov"], maximize=flags["maximize"], foreach=False)


# Buffers are always passed here; momentum 0 (no buffers) has tests of its own. Nesterov needs
# zero dampening, so dampening is swept by tests of its own too.
_SGD_FLAGS = [dict(nesterov=n, maximize=m) for n, m in itertools.product((False, True), repeat=2)]
_SGD_BASE = dict(lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0)
_SGD_HYPER = [
    dict(_SGD_BASE),
    dict(_SGD_BASE, weight_decay=0.1),
    dict(_SGD_BASE, momentum=0.5, weight_decay=0.01, lr=0.03),
]
_SGD_BAD_HYPER = [
    (dict(lr=-0.1), ValueError, r"lr must be >= 0, got"),
    (dict(lr=float("nan")), ValueError, r"lr"),
    (dict(momentum=-0.9), ValueError, r"momentum"),
    (dict(dampening=1.5), ValueError, r"dampening"),
    (dict(weight_decay=-1.0), ValueError, r"weight_decay"),
    (dict(step=0), ValueError, r"step must be a whole number >= 1"),
]

# ---------------------------------------------------------------------------------------------
# LARS (no torch.optim counterpart: the float64 reference is the judge)


def _lars_reference(arrays: dict, *, flags: dict, hyper: dict, step) -> dict:
    p, v = reference.lars(arrays["params"], arrays["grads"], arrays["momentum_buffers"], **hyper)
    return {"params": p, "momentum_buffers": v}


def _lars_state(slot: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    if slot == "momentum_buffers":
        return 0.01 * rng.standard_normal(shape)
    raise KeyError(slot)


_LARS_BASE = dict(lr=0.1, momentum=0.9, weight_decay=0.0, trust_coefficient=0.02, eps=0.0)
_LARS_HYPER = [
    dict(_LARS_BASE),
    dict(_LARS_BASE, weight_decay=1e-3, eps=1e-6),
    dict(_LARS_BASE, momentum=0.0, weight_decay=5e-4, trust_coefficient=0.001, lr=1.0),
]
_LARS_BAD_HYPER = [
    (dict(lr=-0.1), ValueError, r"lr must be >= 0, got"),
    (dict(momentum=-0.9), ValueError, r"momentum"),
    (dict(trust_coefficient=float("nan")), ValueError, r"trust_coefficient"),
    (dict(eps=-1.0), ValueError, r"eps"),
]

# ---------------------------------------------------------------------------------------------
# LAMB (no torch.optim counterpart; Apex FusedLAMB semantics, judged by the float64 reference)


def _lamb_reference(arrays: dict, *, flags: dict, hyper: dict, step) -> dict:
    p, m, v = reference.lamb(arrays["params"], arrays["grads"], arrays["exp_avgs"],
                             arrays["exp_avg_sqs"], step=step, **hyper, **flags)
    return {"params": p, "exp_avgs": m, "exp_avg_sqs": v}


_LAMB_FLAGS = [dict(adam_w_mode=a, use_nvlamb=n) for a, n in itertools.product((True, False), repeat=2)]
_LAMB_BASE = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
_LAMB_HYPER = [
    dict(_LAMB_BASE),
    dict(_LAMB_BASE, weight_decay=0.0),
    dict(_LAMB_BASE, max_grad_norm=1.0, global_grad_norm=5.0),
    dict(_LAMB_BASE, grad_averaging=False, bias_correction=False, beta1=0.5),
]
_LAMB_BAD_HYPER = [
    (dict(beta2=1.0), ValueError, r"beta2"),
    (dict(lr=float("nan")), ValueError, r"lr"),
    (dict(max_grad_norm=1.0), TypeError, r"global_grad_norm"),
    (dict(max_grad_norm=1.0, global_grad_norm=-2.0), ValueError, r"global_grad_norm"),
    (dict(step=0), ValueError, r"step"),
]

OPS = {
    "adam": dict(
        spec=AdamSpec,
        plan=mtapply.adam_plan,  # the public entry points of the op
        step=mtapply.adam_step,
        flag_sets=_ADAM_FLAGS,
        hyper_sets=_ADAM_HYPER,
        reference=_adam_reference,
        init_state=_adam_state,
        torch_optimizer=_adam_torch,
        torch_state={"exp_avgs": "exp_avg", "exp_avg_sqs": "exp_avg_sq",
                     "max_exp_avg_sqs": "max_exp_avg_sq"},
        bad_hyper=_ADAM_BAD_HYPER,
    ),
    "sgd": dict(
        spec=SGDSpec,
        plan=mtapply.sgd_plan,
        step=mtapply.sgd_step,
        flag_sets=_SGD_FLAGS,
        compile_flag_sets=[dict(momentum_buffers=b, nesterov=n, maximize=m)
                           for b, n, m in itertools.product((False, True), repeat=3) if b or not n],
        hyper_sets=_SGD_HYPER,
        reference=_sgd_reference,
        init_state=_sgd_state,
        torch_optimizer=_sgd_torch,
        torch_state={"momentum_buffers": "momentum_buffer"},
        bad_hyper=_SGD_BAD_HYPER,
    ),
    "lars": dict(
        spec=LARSSpec,
        plan=mtapply.lars_plan,
        step=mtapply.lars_step,
        flag_sets=[{}],
        hyper_sets=_LARS_HYPER,
        reference=_lars_reference,
        init_state=_lars_state,
        # the norms are float32 sums, on the CPU as in the kernel (float64 params included)
        norm_dtype="float32",
        torch_optimizer=None,
        torch_state={},
        bad_hyper=_LARS_BAD_HYPER,
    ),
    "lamb": dict(
        spec=LAMBSpec,
        plan=mtapply.lamb_plan,
        step=mtapply.lamb_step,
        flag_sets=_LAMB_FLAGS,
        hyper_sets=_LAMB_HYPER,
        reference=_lamb_reference,
        init_state=_adam_state,
        # the norms are float32 sums, on the CPU as in the kernel (float64 params included)
        norm_dtype="float32",
        torch_optimizer=None,
        torch_state={},
        bad_hyper=_LAMB_BAD_HYPER,
    ),
}


def flag_id(flags: dict) -> str:
    on = [name for name, value in flags.items() if value]
    return "+".join(on) or "plain"


def hyper_id(hyper: dict) -> str:
    return ",".join(f"{k}={v:g}" for k, v in hyper.items())


def op_cases(with_hyper: bool = True):
    """(op name, flags, hyper) for every op, flag set and (optionally) hyperparameter set."""
    for name, row in OPS.items():
        for flags in row["flag_sets"]:
            for hyper in (row["hyper_sets"] if with_hyper else [row["hyper_sets"][0]]):
                yield name, flags, hyper


# ---------------------------------------------------------------------------------------------
# arrays


def make_tensor(values: np.ndarray, dtype: str, lib: str):
    """`values` rounded to `dtype`, as a fresh NumPy array or torch CPU tensor."""
    if lib == "numpy":
        return np.ascontiguousarray(np.asarray(values, dtype=np.float64).astype(dtype))
    import torch

    return torch.from_numpy(np.asarray(values, dtype=np.float64).copy()).to(getattr(torch, dtype))


def to64(tensor) -> np.ndarray:
    """A float64 NumPy copy of a NumPy array or torch CPU tensor (bfloat16 included)."""
    if isinstance(tensor, np.ndarray):
        return tensor.astype(np.float64)
    return tensor.detach().double().numpy().copy()


def raw_bytes(tensor) -> bytes:
    """The exact bytes of a tensor, for bit-identity checks."""
    if isinstance(tensor, np.ndarray):
        return tensor.tobytes()
    import torch

    t = tensor.detach().contiguous()
    return t.view(torch.int16).numpy().tobytes() if t.element_size() == 2 else t.numpy().tobytes()


def assign(tensor, values: np.ndarray) -> None:
    """Writes float64 `values` into `tensor` in place (rounding to its dtype)."""
    if isinstance(tensor, np.ndarray):
        tensor[...] = np.asarray(values).reshape(tensor.shape)
    else:
        import torch

        tensor.detach().copy_(torch.from_numpy(np.asarray(values, np.float64).reshape(tensor.shape)))


def assert_close(actual, expected, dtype: str, what: str, scale: float = 1.0) -> None:
    rtol, atol = TOLERANCES[dtype]
    np.testing.assert_allclose(to64(actual), expected, rtol=rtol * scale, atol=atol * scale,
                               err_msg=what)


def make_slots(op: str, flags: dict, shapes: list, dtypes, lib: str, rng, *, zero_state=False):
    """slot -> list of tensors for `shapes`; dtypes is one dtype or slot -> dtype."""
    row = OPS[op]
    slots = row["spec"](**flags).slots
    dtype_of = dtypes if isinstance(dtypes, dict) else {s: dtypes for s in slots}
    out = {s: [] for s in slots}
    for shape in shapes:
        for s in slots:
            if s == "params":
                values = rng.standard_normal(shape)
            elif s == "grads":
                values = rng.standard_normal(shape)
            else:
                values = np.zeros(shape) if zero_state else row["init_state"](s, shape, rng)
            out[s].append(make_tensor(values, dtype_of[s], lib))
    return out
