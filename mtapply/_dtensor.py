"""FSDP2's DTensor params as mtapply.torch steps them: each rank steps its local shard, and the
state made for a shard is kept as a DTensor sharded as its param, so that `state_dict` and
torch.distributed.checkpoint find every rank's part where they find the param's.

8-bit states: a shard's codes are quantized in blocks of its own memory, so a checkpoint of them
loads into the same sharding (the same number of ranks). Its block scales, a count per rank, are
padded to the count of the largest shard and sharded evenly over the param's shard ranks."""
from __future__ import annotations

import math

import torch

from . import quantization


def is_dtensor(tensor) -> bool:
    return type(tensor).__name__ == "DTensor" and hasattr(tensor, "to_local")


def local_tensor(tensor):
    """The writable local shard of an FSDP2 (DTensor) param, grad or state; else the tensor."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def local_tensors(tensors: list) -> list:
    return list(map(local_tensor, tensors)) if any(map(is_dtensor, tensors)) else tensors


def sharded_like(param, local_state: torch.Tensor):
    """State made for a DTensor param's local shard, as a DTensor sharded as the param (a
    complex param's state made as its real view: the real view of the param's layout)."""
    from torch.distributed.tensor import DTensor

    shape, stride = tuple(param.shape), tuple(param.stride())
    if local_state.dim() == param.dim() + 1:  # (..., 2): real and imaginary parts
        shape, stride = shape + (2,), tuple(2 * s for s in stride) + (1,)
    return DTensor.from_local(local_state, param.device_mesh, param.placements, run_check=False,
                              shape=shape, stride=stride)


def sharded_scales(param, local_scales: torch.Tensor, eight_bit: bool):
    """The block scales of a DTensor param's shard, as a DTensor of shape (shards, blocks of the
    largest shard): each rank's row holds its own, padded (FSDP2 cuts dims as torch.chunk, the
    first shard the largest); none where the param keeps float32 state. Sharded over the
    param's shard ranks (Shard(0)), replicated over its other mesh dimensions, so that a
    checkpoint made over one sharding does not fit another (see `check_scales`)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    most = _most_blocks(param) if eight_bit else 0
    padded = torch.zeros((1, most), dtype=torch.float32, device=local_scales.device)
    padded[0, :local_scales.numel()] = local_scales
    placements = [Shard(0) if p.is_shard() else Replicate() for p in param.placements]
    return DTensor.from_local(padded, param.device_mesh, placements, run_check=False,
                              shape=(_shards(param), most), stride=(most, 1))


def check_scales(param, scales, where: str, name: str) -> None:
    """Raises where a DTensor param's loaded block scales were made over another sharding (8-bit
    codes quantize each shard in blocks of its own memory: they load into the same sharding)."""
    if not (is_dtensor(param) and is_dtensor(scales)) or not scales.numel():
        return
    expected = (_shards(param), _most_blocks(param))
    if tuple(scales.shape) != expected:
        raise ValueError(f"{where} holds {name!r} of shape {tuple(scales.shape)}, made over "
                         f"another sharding than this param's (which takes {expected}): 8-bit "
                         f"states of FSDP2 shards load into the same number of shards; give the "
                         f"param an empty state (optimizer.state[p] = {{}}) to start it afresh")


def shard_scales(scales, param_form) -> torch.Tensor:
    """The scales the plan of a shard takes: those of its blocks, out of `sharded_scales`' padded
    row (a view of it, so the step writes them in place); other tensors as they are."""
    local = local_tensor(scales)
    if local is scales:
        return local
    real = torch.view_as_real(param_form) if param_form.is_complex() else param_form
    return local.reshape(-1)[:quantization.n_blocks(real.numel())]


def _shards(param) -> int:
    return math.prod(param.device_mesh.size(d) for d, placement in enumerate(param.placements)
                     if placement.is_shard())


def _most_blocks(param) -> int:
    shape = list(param.shape)
    for dim_of_mesh, placement in enumerate(param.placements):
        if placement.is_shard():
            shape[placement.dim] = -(-shape[placement.dim] // param.device_mesh.size(dim_of_mesh))
    elements = math.prod(shape) * (2 if param.is_complex() else 1)
    return quantization.n_blocks(elements)
