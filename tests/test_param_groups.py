"""Tracked param groups (mtapply._param_groups): every way of setting a key or editing a
group's params list is noted, with the right names, and the groups pickle and deep-copy as
plain dicts and lists."""
import copy
import pickle

import pytest

from mtapply._param_groups import ANY, PARAMS, GroupChanges, TrackedGroups, TrackedParams


def _groups():
    changes = GroupChanges()
    return TrackedGroups([{"params": [1, 2, 3], "lr": 0.1}, {"params": [4], "lr": 0.2}], changes), changes


def _noted(changes, edit) -> set:
    seen = changes.version
    edit()
    return changes.since(seen)


@pytest.mark.parametrize("edit", [
    lambda p: p.append(9), lambda p: p.extend([9]), lambda p: p.insert(0, 9),
    lambda p: p.pop(), lambda p: p.remove(2), lambda p: p.clear(), lambda p: p.sort(),
    lambda p: p.reverse(), lambda p: p.__setitem__(0, 9), lambda p: p.__delitem__(0),
    lambda p: p.__iadd__([9]), lambda p: p.__imul__(2)])
def test_every_edit_of_a_params_list_notes_params(edit):
    groups, changes = _groups()
    params = groups[0]["params"]
    assert isinstance(params, TrackedParams)
    assert _noted(changes, lambda: edit(params)) == {PARAMS}


def test_a_params_list_set_in_any_way_is_tracked_and_noted():
    groups, changes = _groups()
    for edit in (lambda g: g.__setitem__("params", [7]), lambda g: g.update(params=[7]),
                 lambda g: g.__ior__({"params": [7]}), lambda g: g.setdefault("params", [7])):
        groups.append({"lr": 0.3})  # a group without params yet
        group = groups[-1]
        assert PARAMS in _noted(changes, lambda g=group, e=edit: e(g))
        assert isinstance(group["params"], TrackedParams) and group["params"].changes is changes
        assert _noted(changes, lambda p=group["params"]: p.append(8)) == {PARAMS}


def test_plain_numbers_note_their_key_and_other_values_also_any():
    groups, changes = _groups()
    assert _noted(changes, lambda: groups[0].__setitem__("lr", 0.5)) == {"lr"}
    assert _noted(changes, lambda: groups[0].__setitem__("betas", (0.9, 0.99))) == {"betas", ANY}
    assert _noted(changes, lambda: groups.append({"params": [5]})) >= {ANY}
    assert _noted(changes, lambda: None) == set()
    # the same number again changes nothing; another type or value does
    assert _noted(changes, lambda: groups[0].__setitem__("lr", 0.5)) == set()
    assert _noted(changes, lambda: groups[0].__setitem__("lr", 1)) == {"lr"}
    assert _noted(changes, lambda: groups[0].__setitem__("lr", float("nan"))) == {"lr"}
    assert groups[0]["lr"] != groups[0]["lr"]


def test_groups_pickle_and_deep_copy_as_plain_containers():
    groups, _ = _groups()
    for copied in (pickle.loads(pickle.dumps(groups)), copy.deepcopy(groups)):
        assert type(copied) is list and type(copied[0]) is dict
        assert type(copied[0]["params"]) is list and copied[0]["params"] == [1, 2, 3]
