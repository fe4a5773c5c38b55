"""Plans, rules and optimizers print what a user needs to tell them apart."""
from __future__ import annotations

import numpy as np
import pytest

import mtapply
from mtapply.rules import library


def _adam_lists(dtypes):
    params = [np.zeros(n, dtype) for n, dtype in zip((3, 4, 5), dtypes)]
    moments = [[np.zeros(p.size, np.float32) for p in params] for _ in range(2)]
    return params, [np.zeros_like(p) for p in params], *moments


def test_plan_repr_names_op_options_tensors_devices_dtypes_and_table_mode():
    plan = mtapply.adam_plan(*_adam_lists([np.float32, np.float32, np.float64]),
                             decoupled_weight_decay=True, amsgrad=False, table_mode="unified",
                             max_exp_avg_sqs=None)
    text = repr(plan)
    assert text.startswith("<mtapply Plan adam (decoupled): 3 tensors on cpu")
    # per tensor, the dtypes over its slots: params and grads float64, moments float32
    assert "float32 x2" in text and "float64/float32 x1" in text
    assert text.endswith("table_mode=unified>")


def test_plan_repr_of_one_and_of_no_tensor():
    one = mtapply.sgd_plan([np.zeros(2, np.float32)], [np.zeros(2, np.float32)],
                           [np.zeros(2, np.float32)])
    assert repr(one) == ("<mtapply Plan sgd (momentum): 1 tensor on cpu, float32 x1, "
                         "table_mode=memcpy>")
    empty = mtapply.adam_plan([], [], [], [])
    assert repr(empty) == "<mtapply Plan adam: 0 tensors, table_mode=memcpy>"


def test_rule_repr_names_slots_hyperparameters_and_sums():
    assert repr(library.lion()) == (
        "mtapply.rule('lion', slots='param:rw grad:r exp_avg:rw', "
        "hyper={'lr': None, 'beta1': 0.9, 'beta2': 0.99, 'weight_decay': 0.0})")
    lars = mtapply.rule("lars", slots="param:rw grad:r momentum_buffer:rw",
                        hyper=dict(lr=None, momentum=0.9), sums={"p2": "param * param"},
                        finish="r = sqrt(p2)",
                        update="""
                            momentum_buffer = momentum * momentum_buffer + lr * r * grad
                            param = param - momentum_buffer
                        """)
    assert repr(lars).endswith("hyper={'lr': None, 'momentum': 0.9}, sums=['p2'])")


def test_torch_optimizer_repr_is_torchs_under_mtapplys_name():
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    model = torch.nn.Linear(4, 3)
    text = repr(mt.AdamW(model.parameters(), lr=1e-3, flat_grads=True))
    lines = text.splitlines()
    assert lines[0] == "mtapply.torch.AdamW (flat_grads=True) ("
    assert lines[1] == "Parameter Group 0" and "    lr: 0.001" in lines and lines[-1] == ")"
    # the rest is torch's own listing of the groups' options
    reference = repr(torch.optim.AdamW(model.parameters(), lr=1e-3)).splitlines()
    assert set(reference[1:]) <= set(lines[1:])

    ruled = repr(mt.optimizer(library.lion(), [{"params": [model.weight]},
                                                 {"params": [model.bias], "lr": 2e-3}], lr=1e-3))
    assert ruled.startswith("mtapply.torch.RuleOptimizer (rule=mtapply.rule('lion', ")
    assert "flat_grads=False) (\nParameter Group 0" in ruled and "Parameter Group 1" in ruled
    assert "    lr: 0.002" in ruled


def test_subclass_repr_names_the_subclass():
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    class MyAdam(mt.Adam):
        pass

    assert repr(MyAdam([torch.nn.Parameter(torch.zeros(2))])).startswith(
        f"{__name__}.test_subclass_repr_names_the_subclass.<locals>.MyAdam (flat_grads=False) (")


def test_an_optimizer_prints_while_its_constructor_has_not_added_a_group():
    """A traceback from within the constructor (a refused option) prints the optimizer: torch's
    own listing is one line until the first group is added."""
    torch = pytest.importorskip("torch")
    import mtapply.torch as mt

    seen = []

    class Watched(mt.SGD):
        def add_param_group(self, param_group):
            seen.append(repr(self))
            super().add_param_group(param_group)

    with pytest.raises(ValueError, match="differentiable"):
        Watched([torch.nn.Parameter(torch.ones(2))], lr=0.1, differentiable=True)
    assert seen[0].startswith(f"{Watched.__module__}.") and seen[0].endswith("(\n)")
