"""`state_bits=8` for mtapply.torch optimizers that run an op of their own at 16 and 32 bits
(SGD, LARS, LAMB): with 8-bit state they step by their library rule kept in 8 bits
(`Rule.with_state_bits`), as the rule-run optimizers do (`mtapply._torch_rules.RuleBased`).

Each 8-bit slot keeps torch.optim's name (`momentum_buffer`) and holds uint8 codes of the
blockwise dynamic format of `mtapply.quantization`, with one float32 scale per 256 elements
beside it (`momentum_buffer_absmax`); params of fewer than `min_8bit_size` elements keep
float32 values there and empty scales. A checkpoint of 8-bit state loads only into an
optimizer made with state_bits=8, and one of float state only into one without.
"""
from __future__ import annotations

import torch

from ._torch_rules import RuleBased
from ._torch_state import check_eight_bit_slots, check_state_bits, refuse_other_state_bits


class EightBitState:
    """The 8-bit side of SGD, LARS and LAMB: `_EIGHT_BIT` names the state slots kept in 8 bits
    (those in `_UNSIGNED` hold values >= 0, on the finer unsigned map: second moments),
    `_eight_bit_rule(group)` is the group's rule with them in 8 bits."""

    _EIGHT_BIT: tuple = ()
    _UNSIGNED: tuple = ()
    min_8bit_size = 4096

    def _take_state_bits(self, state_bits, min_8bit_size=4096) -> None:
        check_state_bits(state_bits, min_8bit_size)
        self.state_bits, self.min_8bit_size = state_bits, min_8bit_size
        self._eight_bit_rules = {}

    def __getstate__(self):  # a copy keeps its state's format
        return dict(super().__getstate__(), min_8bit_size=self.min_8bit_size)

    def __setstate__(self, state) -> None:
        super().__setstate__(state)  # (load_state_dict's state lacks it: it stays)
        self.__dict__.setdefault("min_8bit_size", 4096)
        self._eight_bit_rules = {}

    def _library_rule(self, group):
        """The group's rule of `mtapply.rules.library`, as the optimizer's op runs it."""
        raise NotImplementedError

    def _eight_bit_rule(self, group):
        rule = self._library_rule(group)
        made = self._eight_bit_rules.get(rule)
        if made is None:
            made = self._eight_bit_rules[rule] = rule.with_state_bits(
                8, slots=self._EIGHT_BIT, unsigned=self._UNSIGNED, threshold=self.min_8bit_size)
        return made

    def _eight_bit_slot(self, group, name: str, p) -> tuple:
        """(codes, scales) of 8-bit slot `name` of a new state: zero (any codes at scale 0),
        float32 zeros and no scales for a param under min_8bit_size elements."""
        zeros = torch.zeros_like(p, memory_format=torch.preserve_format)
        return RuleBased._eight_bit_state(self._eight_bit_rule(group), name, p, zeros)

    def _eight_bit_plan(self, group, lists, stochastic_rounding: bool):
        rule = self._eight_bit_rule(group)
        given = {"param": lists.bound, "grad": lists.grads}
        return rule.plan(*(given[name] if name in given else lists.state(name)
                           for name in rule.slots), stochastic_rounding=stochastic_rounding)

    def _keeps_dtype(self, key, value) -> bool:
        # uint8 codes, float32 scales, and the float32 state of small params
        return self.state_bits == 8 or super()._keeps_dtype(key, value)

    def _check_entry(self, group, param, entry, where) -> None:
        eight_bit = self._EIGHT_BIT if self.state_bits == 8 else ()
        refuse_other_state_bits(type(self).__name__, eight_bit, entry, where)
        super()._check_entry(group, param, entry, where)
        check_eight_bit_slots(param, eight_bit, entry, where)
