"""mtapply's environment variables (CPU): MTAPPLY_TABLE_MODE is read, and refused when bad, only
where a GPU plan builds its tables, so CPU work ignores it; a relative MTAPPLY_CACHE_DIR names
one folder for the process, taken against the working directory of its first use."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import mtapply
from mtapply import _source, _tables
from mtapply import plan as plan_module


def _adam_lists():
    params = [np.linspace(-1, 1, 7, dtype=np.float32), np.ones((2, 3), np.float32)]
    grads = [np.full_like(p, 0.5) for p in params]
    return params, grads, [np.zeros_like(p) for p in params], [np.zeros_like(p) for p in params]


def _adam_steps():
    lists = _adam_lists()
    for step in (1, 2):
        mtapply.adam_step(*lists, lr=1e-2, step=step)
    return lists[0]


# -- MTAPPLY_TABLE_MODE ----------------------------------------------------------------------------


def test_a_bad_table_mode_leaves_numpy_steps_alone(monkeypatch):
    expected = _adam_steps()
    monkeypatch.setenv("MTAPPLY_TABLE_MODE", "bogus")
    for got, want in zip(_adam_steps(), expected):
        np.testing.assert_array_equal(got, want)
    plan = mtapply.adam_plan(*_adam_lists())
    plan.step(lr=1e-2, step=1)


def test_a_bad_table_mode_leaves_torch_cpu_steps_alone(monkeypatch):
    torch = pytest.importorskip("torch")
    mt = pytest.importorskip("mtapply.torch")
    monkeypatch.setenv("MTAPPLY_TABLE_MODE", "bogus")
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 5))]
    theirs = [torch.nn.Parameter(params[0].detach().clone())]
    ours, reference = mt.AdamW(params, lr=1e-2), torch.optim.AdamW(theirs, lr=1e-2)
    for _ in range(2):
        for p in params + theirs:
            p.grad = torch.full_like(p, 0.5)
        ours.step()
        reference.step()
    torch.testing.assert_close(params[0], theirs[0])


def test_a_bad_table_mode_is_refused_where_gpu_tables_are_built(monkeypatch):
    monkeypatch.setenv("MTAPPLY_TABLE_MODE", "bogus")
    with pytest.raises(ValueError, match=r"MTAPPLY_TABLE_MODE='bogus'; use one of memcpy, unified"):
        _tables.default_mode()
    plan = mtapply.adam_plan(*_adam_lists())  # a CPU plan, made as a GPU plan's launchers are
    with pytest.raises(ValueError, match=r"MTAPPLY_TABLE_MODE='bogus'"):
        plan._launchers(None)


def test_a_gpu_plan_takes_the_table_mode_of_the_variable(monkeypatch):
    monkeypatch.setenv("MTAPPLY_TABLE_MODE", "unified")
    plan = mtapply.adam_plan(*_adam_lists())
    taken = []
    monkeypatch.setattr(plan_module, "launcher_for", lambda *args: taken.append(args[3]))
    monkeypatch.setattr(plan, "_stream_for", lambda device_id, stream: 0)
    plan._launchers(None)
    assert taken == ["unified"] and plan.table_mode == "unified"


def test_a_table_mode_argument_is_still_checked_at_once():
    with pytest.raises(ValueError, match="table_mode='bogus'; use one of"):
        mtapply.adam_plan(*_adam_lists(), table_mode="bogus")


# -- MTAPPLY_CACHE_DIR -----------------------------------------------------------------------------


@pytest.fixture
def fresh_cache_dirs(monkeypatch):
    monkeypatch.setattr(_source, "_absolute_cache_dirs", {})


def test_a_relative_cache_dir_is_resolved_once(tmp_path, monkeypatch, fresh_cache_dirs):
    first, later = tmp_path / "first", tmp_path / "later"
    first.mkdir()
    later.mkdir()
    monkeypatch.chdir(first)
    monkeypatch.setenv("MTAPPLY_CACHE_DIR", "kernels")
    resolved = _source.cache_dir()
    assert resolved == first / "kernels" and resolved.is_absolute()
    monkeypatch.chdir(later)
    assert _source.cache_dir() == resolved  # the cache did not follow the chdir
    monkeypatch.setenv("MTAPPLY_CACHE_DIR", "other/../kernels2")
    assert _source.cache_dir() == later / "kernels2"  # a new value: resolved at its own first use


def test_an_absolute_or_home_cache_dir_is_taken_as_it_is(tmp_path, monkeypatch, fresh_cache_dirs):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("MTAPPLY_CACHE_DIR", "~/kernels")
    assert _source.cache_dir() == tmp_path / "kernels"
    monkeypatch.setenv("MTAPPLY_CACHE_DIR", str(tmp_path / "abs"))
    assert _source.cache_dir() == tmp_path / "abs"
    monkeypatch.delenv("MTAPPLY_CACHE_DIR")
    assert _source.cache_dir() == Path.home() / ".cache" / "mtapply"
    assert os.path.isabs(_source.cache_dir())
