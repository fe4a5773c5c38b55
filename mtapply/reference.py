"""Float64 NumPy references of every op (also the math of the CPU backend).

Each function takes arrays and returns the new values of the slots the op writes. `dtype` is the
type the math runs in: float64 for references, float32 for the CPU backend's fp32/fp16/bf16.
"""
from __future__ import annotations

import math

import numpy as np

from .quantization import dequantize_blockwise, quantize_blockwise


def adam(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq=None, *, lr, step, beta1=0.9,
         beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False, amsgrad=False,
         maximize=False, dtype=np.float64):
    """One Adam/AdamW step as torch.optim.Adam/AdamW define it; `step` counts from 1.

    Returns (param, exp_avg, exp_avg_sq, max_exp_avg_sq or None), new arrays of `dtype` (the
    inputs, which may be the caller's own or views of tensors, are never written)."""
    inputs = [np.asarray(a, dtype=dtype) for a in (param, grad, exp_avg, exp_avg_sq)]
    if amsgrad:
        inputs.append(np.asarray(max_exp_avg_sq, dtype=dtype))
    shape = np.broadcast_shapes(*(a.shape for a in inputs))
    p, g, m, v, *vmax = (np.broadcast_to(a, shape) for a in inputs)
    dests = [np.empty(shape, dtype) for _ in range(4 if amsgrad else 3)]
    adam_into(p, g, m, v, dests, [np.empty(shape, dtype) for _ in range(3)], lr=lr, step=step,
              beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
              decoupled_weight_decay=decoupled_weight_decay, maximize=maximize, dtype=dtype,
              max_exp_avg_sq=vmax[0] if amsgrad else None)
    return (*dests[:3], dests[3] if amsgrad else None)


def adam_into(param, grad, exp_avg, exp_avg_sq, dests, scratch, *, lr, step, beta1=0.9,
              beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled_weight_decay=False,
              maximize=False, dtype=np.float32, max_exp_avg_sq=None) -> None:
    """Adam's operations, each as written in the comments and in that order, with scalars in
    the math's own type (as torch computes them), into arrays given: `dests` (param, exp_avg,
    exp_avg_sq, and max_exp_avg_sq with amsgrad) receive the new values (each may be its
    input's memory); `scratch`: three arrays of the values' size and `dtype`. The inputs are
    arrays of `dtype` of one shape; `max_exp_avg_sq` given means amsgrad."""
    c = dtype
    p, g = param, grad
    held, t, u = scratch
    if maximize:
        g = np.negative(g, out=held)
    if weight_decay != 0:
        if decoupled_weight_decay:
            p = np.multiply(p, c(1 - lr * weight_decay), out=dests[0])
        else:  # g = g + wd * p
            decay = np.multiply(c(weight_decay), p, out=t)
            g = np.add(g, decay, out=held)
    w = c(1 - beta1)
    np.subtract(g, exp_avg, out=t)
    if w < 0.5:  # m = m + w * (g - m)
        np.multiply(t, w, out=t)
        m = np.add(exp_avg, t, out=dests[1])
    else:  # m = g - (g - m) * (1 - w)
        np.multiply(t, c(1) - w, out=t)
        m = np.subtract(g, t, out=dests[1])
    # v = v * beta2 + (1 - beta2) * g * g
    np.multiply(c(1 - beta2), g, out=u)
    np.multiply(u, g, out=u)
    v = np.multiply(exp_avg_sq, c(beta2), out=dests[2])
    np.add(v, u, out=v)
    second = v if max_exp_avg_sq is None else np.maximum(max_exp_avg_sq, v, out=dests[3])
    step_size = lr / (1 - beta1**step)
    # p = p + (-step_size) * (m / (sqrt(second) / sqrt(1 - beta2**step) + eps))
    denom = np.sqrt(second, out=u)
    np.divide(denom, c(math.sqrt(1 - beta2**step)), out=denom)
    np.add(denom, c(eps), out=denom)
    ratio = np.divide(m, denom, out=denom)
    np.multiply(ratio, c(-step_size), out=ratio)
    np.add(p, ratio, out=dests[0])


def adam8bit(param, grad, exp_avg, exp_avg_sq, *, lr, step, block=256, dtype=np.float32,
             **options):
    """One Adam/AdamW step with 8-bit blockwise states (`mtapply.quantization`): each moment is
    (codes uint8, absmax float32 per block); dequantized, stepped as `adam` steps fp32 moments
    (`options` as `adam` takes them, amsgrad excepted), then quantized again with each block's
    fresh absmax. Returns (param, (m codes, m absmax), (v codes, v absmax))."""
    shape = np.shape(param)
    m = dequantize_blockwise(*exp_avg, signed=True, block=block).reshape(shape)
    v = dequantize_blockwise(*exp_avg_sq, signed=False, block=block).reshape(shape)
    p, m, v, _ = adam(param, grad, m, v, lr=lr, step=step, dtype=dtype, **options)
    return (p, quantize_blockwise(m, signed=True, block=block),
            quantize_blockwise(v, signed=False, block=block))


def galore_adamw(param, grad, exp_avg, exp_avg_sq, projector, *, lr, step, beta1=0.9,
                 beta2=0.999, eps=1e-6, weight_decay=0.0, scale=1.0, correct_bias=True,
                 dtype=np.float64):
    """One GaLore AdamW step of one matrix (Zhao et al. 2024, and galore-torch's AdamW): the
    grad projected to rank r by `projector` (("left", P) with P of m x r: R = P^T G; ("right",
    Q) with Q of r x n: R = G Q^T), Adam on R with eps outside the root of the uncorrected
    second moment (step_size = lr * sqrt(1 - beta2**t) / (1 - beta1**t)), the normalized step
    projected back and scaled, then decoupled weight decay on the updated param:
    p = (p - step_size * scale * back(m / (sqrt(v) + eps))) * (1 - lr * weight_decay).
    `projector` None is plain AdamW of that form. Returns (param, exp_avg, exp_avg_sq)."""
    p, g, m, v = (np.asarray(a, dtype=dtype) for a in (param, grad, exp_avg, exp_avg_sq))
    side, ortho = projector if projector is not None else (None, None)
    if side is not None:
        ortho = np.asarray(ortho, dtype=dtype)
        g = ortho.T @ g if side == "left" else g @ ortho.T
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    step_size = lr * (np.sqrt(1 - beta2 ** step) / (1 - beta1 ** step) if correct_bias else 1.0)
    normalized = m / (np.sqrt(v) + eps)
    if side is not None:
        normalized = scale * (ortho @ normalized if side == "left" else normalized @ ortho)
    p = (p - step_size * normalized) * (1 - lr * weight_decay)
    return p, m, v


def sgd(param, grad, momentum_buffer=None, *, lr, step, momentum=0.0, dampening=0.0,
        weight_decay=0.0, nesterov=False, maximize=False, dtype=np.float64):
    """One SGD step as torch.optim.SGD defines it; on step 1 the buffer takes the gradient.

    Returns (param, momentum_buffer or None), new arrays of `dtype`. With momentum 0 the buffer,
    if given, is returned unchanged.
    """
    p, g = (np.asarray(a, dtype=dtype) for a in (param, grad))
    buf = None if momentum_buffer is None else np.asarray(momentum_buffer, dtype=dtype)
    c = lambda x: dtype(x)  # noqa: E731 - scalars enter the math in its own type, as in torch
    if maximize:
        g = -g
    if weight_decay != 0:
        g = g + c(weight_decay) * p
    if momentum != 0:
        buf = g if step < 1.5 else buf * c(momentum) + c(1 - dampening) * g
        g = g + c(momentum) * buf if nesterov else buf
    p = p + c(-lr) * g
    return p, buf


def lars(param, grad, momentum_buffer, *, lr, momentum=0.9, weight_decay=0.0,
         trust_coefficient=0.001, eps=0.0, adapt=True, dtype=np.float64):
    """One LARS step of one tensor (You et al. 2017; Paddle's lars_momentum).

    local_lr = lr * trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps), or lr when
    a norm is zero or `adapt` is False (then weight decay is off too);
    v = momentum * v + local_lr * (g + weight_decay * p);  p = p - v.
    Returns (param, momentum_buffer), new arrays of `dtype`.
    """
    p, g, v = (np.asarray(a, dtype=dtype) for a in (param, grad, momentum_buffer))
    rate, decay = lr, 0.0
    if adapt:
        decay = weight_decay
        p_norm, g_norm = (float(np.sqrt(np.sum(np.square(a, dtype=np.float64)))) for a in (p, g))
        if p_norm > 0 and g_norm > 0:
            rate = lr * trust_coefficient * p_norm / (g_norm + weight_decay * p_norm + eps)
    v = dtype(momentum) * v + dtype(rate) * (g + dtype(decay) * p)
    return p - v, v


def lamb(param, grad, exp_avg, exp_avg_sq, *, lr, step, beta1=0.9, beta2=0.999, eps=1e-6,
         weight_decay=0.01, adam_w_mode=True, grad_averaging=True, bias_correction=True,
         max_grad_norm=0.0, global_grad_norm=0.0, use_nvlamb=False, dtype=np.float64):
    """One LAMB step of one tensor, with Apex FusedLAMB's semantics.

    g = grad / clip (clip = global_grad_norm / max_grad_norm when that exceeds 1);
    L2 mode: g += wd * p.  m = beta1 m + (1 - beta1 or 1) g;  v = beta2 v + (1 - beta2) g^2;
    u = m_hat / (sqrt(v_hat) + eps) (+ wd * p in AdamW mode);
    p -= lr * ratio * u, ratio = ||p|| / ||u|| when wd != 0 or use_nvlamb (1 if a norm is 0).
    Returns (param, exp_avg, exp_avg_sq), new arrays of `dtype`.
    """
    p, g, m, v = (np.asarray(a, dtype=dtype) for a in (param, grad, exp_avg, exp_avg_sq))
    c = dtype
    clip = global_grad_norm / max_grad_norm if max_grad_norm > 0 and global_grad_norm > max_grad_norm else 1.0
    g = g * c(1.0 / clip)
    if not adam_w_mode:
        g = g + c(weight_decay) * p
    m = m * c(beta1) + c(1 - beta1 if grad_averaging else 1.0) * g
    v = v * c(beta2) + c(1 - beta2) * g * g
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    u = (m / c(bc1)) / (np.sqrt(v / c(bc2)) + c(eps))
    if adam_w_mode:
        u = u + c(weight_decay) * p
    ratio = 1.0
    if use_nvlamb or weight_decay != 0:
        p_norm, u_norm = (float(np.sqrt(np.sum(np.square(a, dtype=np.float64)))) for a in (p, u))
        if p_norm != 0 and u_norm != 0:
            ratio = p_norm / u_norm
    return p - c(lr * ratio) * u, m, v


def prodigy(params, grads, state, *, step, lr=1.0, betas=(0.9, 0.999), beta3=None, eps=1e-8,
            weight_decay=0.0, decouple=True, use_bias_correction=False, safeguard_warmup=False,
            d0=1e-6, d_coef=1.0, growth_rate=float("inf")):
    """One Prodigy step over a whole list (Mishchenko and Defazio 2023, "Prodigy: An
    Expeditiously Adaptive Parameter-Free Learner", the algorithm with Adam's moments), in
    float64. `state`: a dict, empty before step 1, of the lists exp_avg, exp_avg_sq, s and p0
    and the numbers d, d_max and d_numerator; updated in place. Returns the new params.

    With d the current estimate and dlr = d * lr (times Adam's bias correction, if used), each
    tensor's g (plus weight_decay * p unless decoupled) moves m = b1 m + d (1 - b1) g,
    v = b2 v + d^2 (1 - b2) g^2 and s = b3 s + (d / d0) dlr g (d / d0 * d g with the safeguard);
    over the whole list, numerator = b3 numerator + sum((d / d0) dlr <g, p0 - p>) and
    denominator = sum(|s|) give d_hat = d_coef numerator / denominator; d rises to d_hat the
    first time (while d is d0), d_max = max(d_max, d_hat), d = min(d_max, d growth_rate).
    Then p -= decay dlr p (decoupled) and p -= dlr m / (sqrt(v) + d eps), with the new d in the
    denominator. A zero denominator leaves params and d unchanged."""
    beta1, beta2 = betas
    beta3 = math.sqrt(beta2) if beta3 is None else beta3
    params = [np.asarray(p, np.float64) for p in params]
    grads = [np.asarray(g, np.float64) for g in grads]
    if not state:
        state.update(exp_avg=[np.zeros_like(p) for p in params],
                     exp_avg_sq=[np.zeros_like(p) for p in params],
                     s=[np.zeros_like(p) for p in params], p0=[p.copy() for p in params],
                     d=d0, d_max=d0, d_numerator=0.0)
    d, d_max = state["d"], state["d_max"]
    correction = (math.sqrt(1 - beta2**step) / (1 - beta1**step)) if use_bias_correction else 1.0
    dlr = d * lr * correction
    numerator, denominator = beta3 * state["d_numerator"], 0.0
    for k, (p, g) in enumerate(zip(params, grads)):
        if not decouple:
            g = g + weight_decay * p
        numerator += d / d0 * dlr * float(np.sum(g * (state["p0"][k] - p)))
        state["exp_avg"][k] = beta1 * state["exp_avg"][k] + d * (1 - beta1) * g
        state["exp_avg_sq"][k] = beta2 * state["exp_avg_sq"][k] + d * d * (1 - beta2) * g * g
        rate = d / d0 * (d if safeguard_warmup else dlr)
        state["s"][k] = beta3 * state["s"][k] + rate * g
        denominator += float(np.sum(np.abs(state["s"][k])))
    if denominator == 0:
        return params
    d_hat = d_coef * numerator / denominator
    if d == d0:
        d = max(d, d_hat)
    d_max = max(d_max, d_hat)
    d = min(d_max, d * growth_rate)
    state.update(d=d, d_max=d_max, d_numerator=numerator)
    out = []
    for k, p in enumerate(params):
        if decouple:
            p = p - weight_decay * dlr * p
        out.append(p - dlr * state["exp_avg"][k] / (np.sqrt(state["exp_avg_sq"][k]) + d * eps))
    return out


def dadapt_adam(params, grads, state, *, step, lr=1.0, betas=(0.9, 0.999), eps=1e-8,
                weight_decay=0.0, decouple=False, use_bias_correction=False, d0=1e-6,
                growth_rate=float("inf"), layer_scale=1.0):
    """One D-Adaptation Adam step over a whole list (Defazio and Mishchenko 2023, "Learning-Rate-
    Free Learning by D-Adaptation", its Adam variant), in float64. `state`: a dict, empty
    before step 1, of the lists exp_avg, exp_avg_sq and s and the numbers d and
    numerator_weighted; updated in place. Returns the new params.

    With d the estimate, r the layer scale and dlr = d * lr (times Adam's bias correction), each
    tensor's g (plus weight_decay * p unless decoupled) adds r dlr <g, s / (sqrt(v) + eps)> to
    the numerator (the s and v before this step), then m = b1 m + r dlr (1 - b1) g,
    v = b2 v + (1 - b2) g^2, s = sqrt(b2) s + dlr (1 - sqrt(b2)) g; over the whole list,
    numerator_weighted = sqrt(b2) numerator_weighted + (1 - sqrt(b2)) numerator and
    d_hat = numerator_weighted / ((1 - sqrt(b2)) sum(r |s|)), d = max(d, min(d_hat, d
    growth_rate)). Then p -= decay dlr p (decoupled) and p -= m / (sqrt(v) + eps). A zero sum
    of |s| leaves params and d unchanged."""
    beta1, beta2 = betas
    root = math.sqrt(beta2)
    params = [np.asarray(p, np.float64) for p in params]
    grads = [np.asarray(g, np.float64) for g in grads]
    if not state:
        state.update(exp_avg=[np.zeros_like(p) for p in params],
                     exp_avg_sq=[np.zeros_like(p) for p in params],
                     s=[np.zeros_like(p) for p in params], d=d0, numerator_weighted=0.0)
    d = state["d"]
    correction = (math.sqrt(1 - beta2**step) / (1 - beta1**step)) if use_bias_correction else 1.0
    dlr = d * lr * correction
    numerator, s_l1 = 0.0, 0.0
    for k, (p, g) in enumerate(zip(params, grads)):
        if not decouple:
            g = g + weight_decay * p
        denom = np.sqrt(state["exp_avg_sq"][k]) + eps
        numerator += layer_scale * dlr * float(np.sum(g * state["s"][k] / denom))
        state["exp_avg"][k] = beta1 * state["exp_avg"][k] + layer_scale * dlr * (1 - beta1) * g
        state["exp_avg_sq"][k] = beta2 * state["exp_avg_sq"][k] + (1 - beta2) * g * g
        state["s"][k] = root * state["s"][k] + dlr * (1 - root) * g
        s_l1 += layer_scale * float(np.sum(np.abs(state["s"][k])))
    if s_l1 == 0:
        return params
    weighted = root * state["numerator_weighted"] + (1 - root) * numerator
    d_hat = weighted / ((1 - root) * s_l1)
    state.update(d=max(d, min(d_hat, d * growth_rate)), numerator_weighted=weighted)
    out = []
    for k, p in enumerate(params):
        if decouple:
            p = p - weight_decay * dlr * p
        out.append(p - state["exp_avg"][k] / (np.sqrt(state["exp_avg_sq"][k]) + eps))
    return out
