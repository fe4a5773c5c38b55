"""Tracked param groups (mtapply._param_groups): every way of setting a key or editing a
group's params list is noted, with the right names, and the groups pickle and deep-copy as
plain dicts and lists."""
import copy
import pickle

import pytest

from mtapply._param_groups import (ANY, PARAMS, GroupChanges, TrackedGroups, TrackedOption,
                                   TrackedParams)


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
    groups[0]["betas"] = [0.9, 0.99]
    for copied in (pickle.loads(pickle.dumps(groups)), copy.deepcopy(groups)):
        assert type(copied) is list and type(copied[0]) is dict
        assert type(copied[0]["params"]) is list and copied[0]["params"] == [1, 2, 3]
        assert type(copied[0]["betas"]) is list and copied[0]["betas"] == [0.9, 0.99]


@pytest.mark.parametrize("edit", [
    lambda b: b.__setitem__(0, 0.5), lambda b: b.__setitem__(slice(0, 1), [0.5]),
    lambda b: b.append(0.1), lambda b: b.extend([0.1]), lambda b: b.insert(0, 0.1),
    lambda b: b.pop(), lambda b: b.remove(0.99), lambda b: b.clear(), lambda b: b.sort(),
    lambda b: b.reverse(), lambda b: b.__delitem__(0), lambda b: b.__iadd__([0.1]),
    lambda b: b.__imul__(2)])
def test_every_in_place_edit_of_a_list_option_notes_its_key(edit):
    changes = GroupChanges()
    groups = TrackedGroups([{"params": [1], "betas": [0.9, 0.99]}], changes)
    betas = groups[0]["betas"]
    assert isinstance(betas, TrackedOption) and betas == [0.9, 0.99]
    assert _noted(changes, lambda: edit(betas)) == {"betas"}


def test_list_options_set_later_are_tracked_and_a_shared_list_stays_shared():
    changes = GroupChanges()
    shared = [0.9, 0.99]  # a default that torch's setdefault put in every group
    groups = TrackedGroups([{"params": [1], "betas": shared}, {"params": [2], "betas": shared}],
                           changes)
    assert groups[0]["betas"] is groups[1]["betas"]
    groups[0]["betas"][0] = 0.5
    assert groups[1]["betas"] == [0.5, 0.99]
    for edit in (lambda g: g.__setitem__("betas", [0.8, 0.9]), lambda g: g.update(betas=[0.8, 0.9]),
                 lambda g: g.setdefault("extra", [1.0])):
        groups.append({"params": [3]})
        group = groups[-1]
        edit(group)
        key = "extra" if "extra" in group else "betas"
        assert isinstance(group[key], TrackedOption)
        assert _noted(changes, lambda: group[key].append(0.0)) == {key}
    # a tuple is immutable: kept as it is
    groups[0]["betas"] = (0.9, 0.99)
    assert type(groups[0]["betas"]) is tuple
