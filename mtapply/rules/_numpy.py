"""A rule's update on the CPU: the checked program evaluated with NumPy, tensor by tensor.

It follows the CUDA functor's arithmetic: every maximal uniform subexpression is computed in
float64 (as the functor's constructor does, once per launch) and rounded to the math type where
element values use it; element values are computed in the math type (float32, or float64 for
float64 params). x**2 is x*x and x**0.5 is sqrt(x) in both.
"""
from __future__ import annotations

import ast

import numpy as np

from ._language import STEP, Program

_ELEMENT_FUNCTIONS = {"sqrt": np.sqrt, "abs": np.abs, "sign": np.sign, "exp": np.exp,
                      "log": np.log, "min": np.fmin, "max": np.fmax}


def evaluate(program: Program, arrays: dict, scalars: dict, dtype, state=None) -> dict:
    """New values of the written slots of one tensor. `arrays`: slot name -> values in `dtype`;
    `scalars`: hyperparameter (and step) name -> float; `state`: the float32 array of the
    rule's scalar state (see `Rule.initial_scalars`), updated here."""
    shape = next(iter(arrays.values())).shape
    env = {name: np.float64(value) for name, value in scalars.items()}
    n_state, parity = len(program.scalars), int(scalars.get(STEP, 0)) & 1
    env.update({name: np.float64(state[(1 - parity) * n_state + k])
                for k, name in enumerate(program.scalars)})
    env.update(arrays)
    with np.errstate(all="ignore"):
        if program.sums:  # the first pass: its lines on copies, then each tensor's sums
            first = dict(env)
            evaluator = _Evaluator(program, first, dtype)
            for line in program.lines[:program.prefix]:
                first[line.target] = evaluator.value(line.expr)
            for total in program.sums:
                value = evaluator.element(total.expr)
                # the kernel adds in float32 in a fixed order; here in float64, rounded once
                env[total.name] = np.float64(np.float32(
                    np.sum(np.broadcast_to(np.asarray(value, np.float64), shape))))
        evaluator = _Evaluator(program, env, dtype)
        for line in program.lines:
            env[line.target] = evaluator.value(line.expr)
    for k, name in enumerate(program.scalars):
        state[parity * n_state + k] = state[2 * n_state + k] = np.float32(env[name])
    return {s.name: np.broadcast_to(np.asarray(env[s.name], dtype), shape).copy()
            for s in program.slots if s.written}


class _Evaluator:
    def __init__(self, program: Program, env: dict, dtype):
        self.program, self.env, self.dtype = program, env, dtype

    def value(self, node):
        """The node's value: a float64 scalar when uniform, else an array in the math type."""
        return self.uniform(node) if self.program.kind(node).uniform else self.element(node)

    def element(self, node):
        if self.program.kind(node).uniform:  # hoisted: computed in float64, then rounded
            value = self.uniform(node)
            return value if isinstance(value, (bool, np.bool_)) else self.dtype(value)
        if isinstance(node, ast.Name):  # a slot, or a temporary of element values
            return self.env[node.id]
        return self._apply(node, self.element)

    def uniform(self, node):
        if isinstance(node, ast.Constant):
            return np.float64(node.value)
        if isinstance(node, ast.Name):
            return np.float64(self.env[node.id]) if node.id == STEP else self.env[node.id]
        return self._apply(node, self.uniform)

    def _apply(self, node, sub):
        one = self.dtype(1) if sub == self.element else np.float64(1)
        if isinstance(node, ast.UnaryOp):
            operand = sub(node.operand)
            return -operand if isinstance(node.op, ast.USub) else operand
        if isinstance(node, ast.BinOp):
            return _binary(node, sub)
        if isinstance(node, ast.Compare):
            left, right = sub(node.left), sub(node.comparators[0])
            return _COMPARE[type(node.ops[0])](left, right)
        name = node.func.id
        args = [sub(arg) for arg in node.args]
        if name == "where":
            return np.where(*args) if sub == self.element else (args[1] if args[0] else args[2])
        if name == "rsqrt":
            return one / np.sqrt(args[0])
        return _ELEMENT_FUNCTIONS[name](*args)


def _binary(node: ast.BinOp, sub):
    left = sub(node.left)
    if isinstance(node.op, ast.Pow) and isinstance(node.right, ast.Constant):
        if node.right.value == 2:
            return left * left
        if node.right.value == 0.5:
            return np.sqrt(left)
    right = sub(node.right)
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    if isinstance(node.op, ast.Div):
        return left / right
    if isinstance(node.op, ast.Mod):  # as the kernel computes it (Python's sign convention)
        return left - right * np.floor(left / right)
    return np.power(left, right)


_COMPARE = {ast.Lt: np.less, ast.LtE: np.less_equal, ast.Gt: np.greater,
            ast.GtE: np.greater_equal, ast.Eq: np.equal, ast.NotEq: np.not_equal}
