"""How `mtapply.torch.Muon` keeps its state at `state_bits` 32, 16 or 8 (bitsandbytes'
`optim_bits`): a Muon group's `momentum_buffer`, and a `use_muon=False` group's AdamW moments
(`exp_avg`, `exp_avg_sq`), in the param's dtype, in bfloat16, or as 8-bit codes of the
blockwise dynamic format (`mtapply.quantization`) with one float32 scale per 256 elements
beside each (`<name>_absmax`), as every rule-run mtapply.torch optimizer keeps them. Params
of fewer than `min_8bit_size` elements keep float32 values and empty scales.

torch.optim's `load_state_dict` casts every floating state tensor to its param's dtype (and
uint8 codes would be cast too): `Storage.loaded` gives each loaded tensor back its storage.
"""
from __future__ import annotations

import functools

import torch

from . import quantization
from ._dtensor import is_dtensor, local_tensor, shard_scales
from ._torch_rules import RuleBased
from ._torch_state import check_eight_bit_slots, check_state_bits, refuse_other_state_bits
from .rules import library

MUON_STATE, ADAMW_STATE = ("momentum_buffer",), ("exp_avg", "exp_avg_sq")


@functools.lru_cache(maxsize=None)
def _eight_bit(rule, slots: tuple, unsigned: tuple, threshold: int):
    return rule.with_state_bits(8, slots=slots, unsigned=unsigned, threshold=threshold)


class Storage:
    """The state storage of one optimizer: its rules, new state and checks."""

    def __init__(self, state_bits=32, min_8bit_size=4096):
        check_state_bits(state_bits, min_8bit_size)
        self.bits, self.min_8bit_size = state_bits, min_8bit_size

    def momentum_rule(self, nesterov: bool):
        rule = library.muon_momentum(bool(nesterov))
        return self._stored(rule, MUON_STATE, ())

    def adamw_rule(self):
        return self._stored(library.adam(decoupled_weight_decay=True), ADAMW_STATE,
                            ("exp_avg_sq",))

    def _stored(self, rule, slots: tuple, unsigned: tuple):
        if self.bits != 8:  # (16: the rule's kernels take bfloat16 state as it is)
            return rule
        return _eight_bit(rule, slots, unsigned, self.min_8bit_size)

    @staticmethod
    def names(muon: bool) -> tuple:
        return MUON_STATE if muon else ADAMW_STATE

    def dtype(self, p) -> torch.dtype:
        """The dtype of `p`'s state slots at 16 or 32 bits."""
        return torch.bfloat16 if self.bits == 16 else p.dtype

    def make(self, p, state: dict, muon: bool) -> None:
        """The param's state slots that `state` lacks, at zero."""
        # (nesterov does not change how the buffer is stored)
        rule = self.momentum_rule(True) if muon else self.adamw_rule()
        for name in self.names(muon):
            if name in state:
                continue
            zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
            if self.bits == 8:
                state[name], state[f"{name}_absmax"] = RuleBased._eight_bit_state(
                    rule, name, p, zeros)
            else:
                state[name] = zeros.to(self.dtype(p))

    @staticmethod
    def arguments(rule, params: list, state, given: dict) -> list:
        """The rule's lists in its slot order: those `given` by name, the rest from `state`
        (8-bit codes and their scales among them); of a DTensor param (an FSDP2 shard), its
        local shard's."""
        lists = [given[name] if name in given else [state[p][name] for p in params]
                 for name in rule.slots]
        if not any(map(is_dtensor, params)):
            return lists
        return [[shard_scales(x, local_tensor(p)) if name.endswith("_absmax") else local_tensor(x)
                 for x, p in zip(column, params)] for name, column in zip(rule.slots, lists)]

    def check(self, p, entry, muon: bool, where) -> None:
        """A param's state as this storage keeps it: refuses state saved at other state_bits,
        and slots that do not lie as the param does. `where()` names the param."""
        self.check_saved(p, entry, muon, where)
        for name in self.names(muon):
            if name not in entry:
                continue
            value = entry[name]
            if self.bits == 8:
                self._check_scales(p, value, entry[f"{name}_absmax"], f"{where()}'s state {name!r}")
            dtype = value.dtype if self.bits == 8 else self.dtype(p)
            if (value.shape, value.dtype, value.device, value.stride()) != (
                    p.shape, dtype, p.device, p.stride()):
                raise ValueError(f"{where()}'s state {name!r} is {tuple(value.shape)} "
                                 f"{value.dtype} on {value.device} with strides {value.stride()}, "
                                 f"but the param is {tuple(p.shape)} on {p.device} with strides "
                                 f"{p.stride()} and state_bits={self.bits} keeps it {dtype}: "
                                 f"give it the param's shape, device and layout")

    @staticmethod
    def _check_scales(p, codes, scales, what: str) -> None:
        if is_dtensor(p):  # its shard's, out of the padded row of each shard (see _dtensor)
            p = local_tensor(p)
            codes, scales = local_tensor(codes), shard_scales(scales, p)
        blocks = quantization.n_blocks(p.numel()) if codes.dtype == torch.uint8 else 0
        if (scales.dtype, scales.numel(), scales.device) != (torch.float32, blocks, p.device) \
                or not scales.is_contiguous():
            raise ValueError(f"{what} has {scales.numel()} {scales.dtype} scales on "
                             f"{scales.device}, but its {codes.dtype} values on {p.device} take "
                             f"{blocks} contiguous float32 ones there (one per 256 elements of "
                             f"8-bit codes, none for float32 values); give the param an empty "
                             f"state (optimizer.state[p] = {{}}) to start it afresh")

    def check_saved(self, p, entry, muon: bool, where) -> None:
        """A saved entry about to be loaded: refused where it holds state saved at other
        state_bits (its float dtypes are converted on loading)."""
        names = self.names(muon)
        refuse_other_state_bits("Muon", names if self.bits == 8 else (), entry, where)
        if self.bits == 8:
            check_eight_bit_slots(p, names, entry, where)

    def loaded(self, p, value):
        """A saved state tensor (not `step`) in this storage's dtype, on the param's device,
        laid out as the param (torch.optim.Muon's buffers lie as their first grads did)."""
        if self.bits == 8 or not value.is_floating_point():
            return value.to(device=p.device)  # codes, scales and small float32 state as saved
        value = value.to(device=p.device, dtype=self.dtype(p))
        if value.shape == p.shape and value.stride() != p.stride():
            value = torch.empty_like(p, dtype=value.dtype).copy_(value)
        return value
