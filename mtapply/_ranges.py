"""The values a step argument may take (`Range`), shared by the ops, the rules' declared
hyperparameter ranges and the kernels' checks of device values."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Range:
    """The values a step argument may take. A number outside is refused on the host (a
    ValueError naming the argument); a device value outside makes every kernel of the step
    write nothing (as found_inf does) and raise the plan's `invalid` flag. NaN is never in."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    finite: bool = False
    whole: bool = False  # an integer
    text: str = field(default="", compare=False)  # in words, as declared (">= 0"; finite implied)

    def holds(self, v: float) -> bool:
        return ((self.low < v if self.low_open else self.low <= v)
                and (v < self.high if self.high_open else v <= self.high)
                and (not self.finite or v - v == 0.0) and (not self.whole or v.is_integer()))

    def check(self, name: str, value) -> float:
        """`value` as a float, or ValueError/TypeError naming `name` and the range."""
        if type(value) is not float:  # the common case costs one type test: this runs every step
            value = _to_float(name, value)
        if not self.holds(value):
            raise ValueError(f"{name} must be {self.describe(value)}, got {value!r}")
        return value

    def describe(self, value: float | None = None) -> str:
        """The range in words; for an infinite `value` refused, "finite" said first where the
        words leave it implied (inf is >= 1, yet not allowed)."""
        if self.text:
            infinite = value is not None and math.isinf(value)
            if self.finite and infinite and "finite" not in self.text:
                return f"finite and {self.text}"
            return self.text
        parts = []
        low, high = self.low > -math.inf, self.high < math.inf
        if low and high:
            parts.append(f"{'(' if self.low_open else '['}{self.low}, "
                         f"{self.high}{')' if self.high_open else ']'}")
        elif low:
            parts.append(f">{'' if self.low_open else '='} {self.low}")
        elif high:
            parts.append(f"<{'' if self.high_open else '='} {self.high}")
        if self.finite:
            parts.append("finite")
        if self.whole:
            parts.append("a whole number")
        return " and ".join(parts) or "a number (not NaN)"

    def kernel_check(self, word: int, count: int) -> tuple:
        """(word, count, low, high, flags): the kernel's check of `count` float32 values at the
        address in argument word `word` (kernels/walker.cuh, MTA_SCALAR_CHECKS)."""
        low, high = self.low > -math.inf, self.high < math.inf
        flags = (low * CHECK_LOW | (low and self.low_open) * CHECK_LOW_OPEN | high * CHECK_HIGH
                 | (high and self.high_open) * CHECK_HIGH_OPEN | self.finite * CHECK_FINITE
                 | self.whole * CHECK_WHOLE)
        return (word, count, float(self.low) if low else 0.0, float(self.high) if high else 0.0,
                int(flags))

    def first_outside(self, values: np.ndarray) -> int | None:
        """The index of the first of `values` outside the range (NaN included), else None."""
        v = np.asarray(values, np.float64)
        inside = (v > self.low if self.low_open else v >= self.low) & (
            v < self.high if self.high_open else v <= self.high)
        if self.finite:
            inside &= np.isfinite(v)
        if self.whole:
            inside &= v == np.floor(v)
        return None if inside.all() else int(np.flatnonzero(~inside)[0])


CHECK_LOW, CHECK_LOW_OPEN, CHECK_HIGH, CHECK_HIGH_OPEN, CHECK_FINITE, CHECK_WHOLE = (
    1, 2, 4, 8, 16, 32)  # as kernels/walker.cuh numbers them
ANY = Range()  # a number: anything but NaN
LR = Range(low=0.0, finite=True, text=">= 0")
STEP = Range(low=1.0, finite=True, whole=True, text="a whole number >= 1")  # the 1-based step count
GRAD_SCALE = Range(low=0.0, low_open=True, finite=True, text="> 0")  # AMP's loss scale
NORM = Range(low=0.0, finite=True, text=">= 0")  # a norm given to a step (LAMB's global_grad_norm)
FACTOR = Range(finite=True, text="a finite number")  # a factor or addend of the list utilities
RANGES = {"lr": LR, "step": STEP}  # of the names every op that takes them reads alike
FINITE = Range(finite=True, text="a finite number")  # a declared hyperparameter without bounds: any finite number
_NUMBER = r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*"
_BOUND = re.compile(rf"\s*(>=|>|<=|<){_NUMBER}")
_NUMBERS = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_INTERVAL = re.compile(rf"\s*([\[(]){_NUMBER},{_NUMBER}([\])])\s*")


def parse(name: str, text) -> Range:
    """A declared range of finite numbers: ">= a", "> a", "<= b", "< b" or an interval
    "[a, b)" (any brackets)."""
    if not isinstance(text, str):
        raise TypeError(f"hyper: the range of {name!r} must be a string such as \">= 0\" or "
                        f"\"[0, 1)\", got {text!r}")
    bounds = [float(v) for v in _NUMBERS.findall(text)]
    if any(not math.isfinite(v) for v in bounds):
        raise ValueError(f"hyper: the range {text!r} of {name!r} has a bound beyond the range "
                         "of a double, in which the kernels check it")
    bound = _BOUND.fullmatch(text)
    if bound:
        op, value = bound.group(1), float(bound.group(2))
        if op[0] == ">":
            return Range(low=value, low_open=op == ">", finite=True, text=text.strip())
        return Range(high=value, high_open=op == "<", finite=True, text=text.strip())
    interval = _INTERVAL.fullmatch(text)
    if interval:
        low, high = float(interval.group(2)), float(interval.group(3))
        if low > high:
            raise ValueError(f"hyper: the range {text!r} of {name!r} is empty (low > high)")
        return Range(low=low, high=high, low_open=interval.group(1) == "(",
                     high_open=interval.group(4) == ")", finite=True, text=text.strip())
    raise ValueError(f"hyper: {text!r} is not a range of {name!r}: write \">= 0\", \"> 0\", "
                     f"\"<= 1\", \"< 1\" or an interval such as \"[0, 1)\"")


def _to_float(name: str, value) -> float:
    if isinstance(value, bool) or hasattr(value, "__dlpack__") or not hasattr(value, "__float__"):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    return float(value)
