"""torch.optim's argument checks, with its messages, as mtapply.torch's constructors make them."""
from __future__ import annotations

import torch


def check_one_element(value, name: str) -> None:
    """torch.optim's refusal of a tensor option of several elements (an lr, in torch)."""
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise ValueError(f"Tensor {name} must be 1-element")


def check_options(**values) -> None:
    """torch.optim's checks of non-negative options, with its messages."""
    check_one_element(values.get("lr"), "lr")
    for name, value in values.items():
        if not 0.0 <= float(value):
            label = {"lr": "learning rate", "eps": "epsilon value"}.get(name, f"{name} value")
            raise ValueError(f"Invalid {label}: {value}")


def check_adam_args(lr, betas, eps, weight_decay) -> None:
    """torch.optim.Adam's argument checks and messages."""
    check_one_element(lr, "lr")
    if not 0.0 <= float(lr):
        raise ValueError(f"Invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"Invalid weight_decay value: {weight_decay}")




def check_torch_adam_flags(lr, betas, foreach, fused, capturable) -> None:
    """torch.optim.Adam's refusals of its flag combinations, with its messages (mtapply's one
    step would take them, but code written for torch.optim never meets them)."""
    if foreach and fused:
        raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
    if isinstance(betas[0], torch.Tensor) != isinstance(betas[1], torch.Tensor):
        raise ValueError("betas must be either both floats or both Tensors")
    if foreach and not capturable:
        if isinstance(lr, torch.Tensor):
            raise ValueError("lr as a Tensor is not supported for capturable=False and "
                             "foreach=True")
        if isinstance(betas[0], torch.Tensor):
            raise ValueError("betas[0] as a Tensor is not supported for capturable=False and "
                             "foreach=True")


def check_adafactor_args(lr, beta2_decay, eps, d, weight_decay) -> None:
    """torch.optim.Adafactor's argument ranges, refused in torch's words (its tests match
    them), each naming its argument."""
    check_one_element(lr, "lr")
    if not 0.0 <= float(lr):
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 >= beta2_decay:
        raise ValueError(f"beta2_decay should be <= 0 but is: {beta2_decay}")
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise ValueError(f"eps must be a pair (eps1 or None, eps2), got {eps!r}")
    if eps[0] is not None and not 0.0 <= eps[0]:
        raise ValueError(f"epsilon1 should be >= 0 but is: {eps[0]} (eps[0]; None is allowed)")
    if not 0.0 <= eps[1]:
        raise ValueError(f"epsilon2 should be >= 0 but is: {eps[1]} (eps[1])")
    if not 1.0 <= d:
        raise ValueError(f"Clipping threshold d should be >= 1 but is: {d}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight_decay should be >= 0 but is: {weight_decay}")
