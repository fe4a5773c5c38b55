"""mtapply.torch's optimizers on float16 and bfloat16 params, on the CPU.

Each optimizer is run beside a reference fed the very same grads: torch.optim's single-tensor
implementation (foreach=False) in the same dtype where torch has the optimizer, else the same
mtapply optimizer on float32 copies of the params. Params and every floating state are
compared after each step within the tolerances torch's own tests use in these dtypes: atol =
rtol = 5e-3, as they compare a fused step with the forloop one, and for bfloat16 an rtol of
1.6e-2 (torch.testing's default: two units in the last place, since one such unit is up to
0.8% and the two sides may round a value apart). mtapply computes in float32 and rounds each
stored value once, torch's forloop rounds after every op, so they differ by rounding alone.

A rounding error is relative to the operands, which a cancellation (a momentum buffer meeting
a grad of the other sign) may leave far larger than the result: each value is compared within
rtol of the largest the reference holds in that state (or the params) across all params as
well (atol = max(atol, rtol * max |reference|)).

Values are of the scale of torch's own tests (params and grads about 0.1, grads bounded away
from 0), and eps is 1e-4 where the default (1e-8) is below float16's smallest normal number:
torch's forloop adds it in float16, where it is 0, and divides by zero wherever a second
moment underflowed to 0 (mtapply, like torch's fused step, divides in float32).
"""
import pytest

torch = pytest.importorskip("torch")

import mtapply.torch as mt  # noqa: E402
from mtapply.rules import library  # noqa: E402

DTYPES = [torch.float16, torch.bfloat16]
TOLERANCES = {torch.float16: dict(atol=5e-3, rtol=5e-3),
              torch.bfloat16: dict(atol=5e-3, rtol=1.6e-2)}
STEPS = 8
SHAPES = [(7, 5), (5,), (3, 4, 2), (1,)]
SCALE = 0.1

# (mtapply class, torch.optim class, options): the optimizers torch.optim has
WITH_TORCH = [
    (mt.Adam, torch.optim.Adam, dict(lr=1e-2, eps=1e-4)),
    (mt.Adam, torch.optim.Adam, dict(lr=1e-2, eps=1e-4, weight_decay=0.1, amsgrad=True)),
    (mt.Adam, torch.optim.Adam, dict(lr=1e-2, eps=1e-4, betas=(0.3, 0.9), maximize=True)),
    (mt.AdamW, torch.optim.AdamW, dict(lr=1e-2, eps=1e-4, weight_decay=0.1)),
    (mt.SGD, torch.optim.SGD, dict(lr=0.05)),
    (mt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.1)),
    (mt.SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.5, dampening=0.2, maximize=True)),
    (mt.Adagrad, torch.optim.Adagrad, dict(lr=0.05)),
    (mt.Adagrad, torch.optim.Adagrad, dict(lr=0.05, lr_decay=0.01, weight_decay=0.1,
                                            initial_accumulator_value=0.1)),
    (mt.RMSprop, torch.optim.RMSprop, dict(lr=1e-2, eps=1e-4)),
    (mt.RMSprop, torch.optim.RMSprop, dict(lr=1e-2, eps=1e-4, centered=True, momentum=0.9,
                                            weight_decay=0.1)),
    (mt.RMSprop, torch.optim.RMSprop, dict(lr=1e-2, eps=1e-4, alpha=0.9, momentum=0.5,
                                            maximize=True)),
]

# (mtapply optimizer maker, options): the others, against themselves on float32 params
ALONE = [
    (mt.LARS, dict(lr=0.1, weight_decay=1e-3)),
    (mt.LARS, dict(lr=0.01, exclude=True)),
    (mt.LAMB, dict(lr=1e-2, max_grad_norm=1.0)),
    # a sign taken of a moment rounded apart moves a param by 2 lr: at most 1.6e-3 in 8 steps
    (mt.Lion, dict(lr=1e-4, weight_decay=0.1)),
    (mt.Adan, dict(lr=1e-2, eps=1e-4, weight_decay=0.02)),
    (mt.ScheduleFreeAdamW, dict(lr=1e-2, eps=1e-4, warmup_steps=3)),
    (mt.Adam8bit, dict(lr=1e-2, eps=1e-4, min_8bit_size=1)),
    (mt.AdamW8bit, dict(lr=1e-2, eps=1e-4, min_8bit_size=1)),
    (lambda params, **kw: mt.optimizer(library.adan(), params, **kw), dict(lr=1e-2, eps=1e-4)),
    (mt.GaLoreAdamW, dict(lr=1e-2, eps=1e-4, weight_decay=0.01)),
]


def _params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * SCALE).to(dtype)) for s in SHAPES]


def _grads(dtype, steps):
    """Grads of magnitude SCALE / 2 to 3 SCALE / 2 and either sign, rounded to the dtype (the
    reference reads these very values)."""
    g = torch.Generator().manual_seed(1)

    def grad(shape):
        magnitude = SCALE * (0.5 + torch.rand(shape, generator=g))
        return torch.where(torch.rand(shape, generator=g) < 0.5, -magnitude, magnitude)

    return [[grad(s).to(dtype) for s in SHAPES] for _ in range(steps)]


def _close(actual, expected, tolerance, scale: float, what: str) -> None:
    atol = max(tolerance["atol"], tolerance["rtol"] * scale)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=tolerance["rtol"],
                               msg=lambda m: f"{what}: {m}")


def _scales(ref, ref_params) -> dict:
    """The largest magnitude of the params and of each state across all params."""
    scales = {"param": max(float(q.detach().abs().max()) for q in ref_params)}
    for q in ref_params:
        for name, value in ref.state[q].items():
            if torch.is_tensor(value) and value.is_floating_point() and value.numel():
                scales[name] = max(scales.get(name, 0.0), float(value.abs().max()))
    return scales


def _assert_close(opt, ref, params, ref_params, step):
    tolerance, scales = TOLERANCES[params[0].dtype], _scales(ref, ref_params)
    for k, (p, q) in enumerate(zip(params, ref_params)):
        _close(p.detach().float(), q.detach().float(), tolerance, scales["param"],
               f"param {k} after step {step}")
        for name, value in opt.state[p].items():
            other = ref.state[q].get(name)
            if not torch.is_tensor(value) or value.dtype == torch.uint8 or other is None:
                continue  # 8-bit codes are compared through the params they step
            _close(value.float(), other.float(), tolerance, scales.get(name, 0.0),
                   f"{name} of param {k} after step {step}")


def _run(opt, ref, params, ref_params, dtype, ref_dtype):
    for step, grads in enumerate(_grads(dtype, STEPS), 1):
        for p, q, g in zip(params, ref_params, grads):
            p.grad, q.grad = g.clone(), g.to(ref_dtype)
        opt.step()
        ref.step()
        _assert_close(opt, ref, params, ref_params, step)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ours,theirs,options", WITH_TORCH,
                         ids=[f"{c.__name__}-{k}" for k, (c, _, _) in enumerate(WITH_TORCH)])
def test_matches_torch_forloop(ours, theirs, options, dtype):
    params, ref_params = _params(dtype), _params(dtype)
    opt, ref = ours(params, **options), theirs(ref_params, foreach=False, **options)
    _run(opt, ref, params, ref_params, dtype, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("make,options", ALONE, ids=[f"{getattr(m, '__name__', 'rule')}-{k}"
                                                     for k, (m, _) in enumerate(ALONE)])
def test_matches_itself_on_float32_params(make, options, dtype):
    params = _params(dtype)
    ref_params = [torch.nn.Parameter(p.detach().float()) for p in params]
    opt, ref = make(params, **options), make(ref_params, **options)
    _run(opt, ref, params, ref_params, dtype, torch.float32)


def test_galore_projected_steps_match_float32_in_bfloat16():
    params = [torch.nn.Parameter((torch.randn(12, 8) * 0.5).to(torch.bfloat16))]
    ref_params = [torch.nn.Parameter(params[0].detach().float())]
    opt = mt.GaLoreAdamW([{"params": params, "rank": 4, "update_proj_gap": 3}], lr=1e-2)
    ref = mt.GaLoreAdamW([{"params": ref_params, "rank": 4, "update_proj_gap": 3}], lr=1e-2)
    g = torch.Generator().manual_seed(2)
    for step in range(1, STEPS + 1):
        grad = torch.randn(12, 8, generator=g).to(torch.bfloat16)
        params[0].grad, ref_params[0].grad = grad.clone(), grad.float()
        opt.step()
        ref.step()
        torch.testing.assert_close(params[0].detach().float(), ref_params[0].detach(),
                                   atol=2e-2, rtol=2e-2)
