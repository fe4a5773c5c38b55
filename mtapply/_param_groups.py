"""Param groups that note what was set in them, so that a step over many groups reads nothing
per group while nothing changed, and only each group's lr when a scheduler set it.

An optimizer's `param_groups` become a `TrackedGroups` list of `TrackedGroup` dicts (copies of
the dicts it was given); setting a key notes its name (and `ANY` too unless the value is a plain
number; a number equal to the one held changes nothing), and any other change of a group or of
the list notes `ANY`. Each group's params list is a `TrackedParams`, which notes `PARAMS` when it
is edited in place, so that a step learns in O(1) that no param was added, removed or replaced.
A list-valued option (betas given as a list) becomes a `TrackedOption`, which notes its key when
edited in place (`group["betas"][0] = 0.8`), as torch.optim reads the list anew at each step; a
list put in several groups (a default shared by torch's `setdefault`) stays one list. Lists are
copied in: edit them through the group. They pickle and deep-copy as plain lists and dicts.
"""
from __future__ import annotations

from ._tracking import SetsThroughSetitem, notes_edits

ANY = "*"  # noted for changes that are not one key set: a group added, a key deleted, ...
PARAMS = "params"  # noted when a group's params list is set or edited in place


class GroupChanges:
    """When each key was last set in one optimizer's param groups, counted in changes: a
    reader keeps the `version` it has seen and asks what was set `since` then."""

    def __init__(self):
        self.version = 1
        self.set_at = {ANY: 1}
        self.options: dict = {}  # id(a list given as an option) -> (that list, its TrackedOption)

    def option(self, key, value: list) -> TrackedOption:
        """The tracked copy of a list given as option `key`: one per list given."""
        held = self.options.get(id(value))
        if held is None or held[0] is not value:  # (the list is held, so its id stays its own)
            held = self.options[id(value)] = (value, TrackedOption(value, self, key))
        return held[1]

    def note(self, name) -> None:
        self.version += 1
        self.set_at[name] = self.version

    def since(self, seen: int) -> set:
        """The names set after version `seen` (ANY for a reader that saw none)."""
        if seen == self.version:
            return set()
        return {name for name, version in self.set_at.items() if version > seen}


class TrackedParams(list):
    """A group's params list, noting `PARAMS` when edited in place."""

    __slots__ = ("changes",)

    def __init__(self, params, changes: GroupChanges):
        super().__init__(params)
        self.changes = changes

    def _changed(self) -> None:
        self.changes.note(PARAMS)

    def __reduce__(self):
        return list, (list(self),)


class TrackedOption(list):
    """A list-valued option of param groups, noting its key when edited in place."""

    __slots__ = ("changes", "key")

    def __init__(self, values, changes: GroupChanges, key):
        super().__init__(values)
        self.changes, self.key = changes, key

    def _changed(self) -> None:
        self.changes.note(self.key)

    def __reduce__(self):
        return list, (list(self),)


class TrackedGroup(SetsThroughSetitem, dict):
    """A param group noting each key set in it; its "params" is a `TrackedParams`."""

    __slots__ = ("changes",)

    def __init__(self, group: dict, changes: GroupChanges):
        super().__init__(group)
        self.changes = changes
        for key, value in self.items():
            if key == PARAMS or type(value) is list:
                dict.__setitem__(self, key, self._tracked(key, value))

    def _tracked(self, key, value):
        """`value` as the group holds it: params and list options tracked by this group's
        changes, anything else as given."""
        if isinstance(value, (TrackedParams, TrackedOption)) and value.changes is self.changes:
            return value
        if key == PARAMS:
            return TrackedParams(value, self.changes)
        if isinstance(value, list):
            return self.changes.option(key, value)
        return value

    def __setitem__(self, key, value) -> None:
        kind = type(value)
        if kind is float or kind is int:  # the common case (a scheduler's lr): kept short
            held = dict.get(self, key)
            if type(held) is kind and held == value:
                return  # the same number again: a scheduler sets every group's lr every step
            dict.__setitem__(self, key, value)
            self.changes.note(key)
            return
        dict.__setitem__(self, key, self._tracked(key, value))
        self.changes.note(key)
        self.changes.note(ANY)

    def _changed(self) -> None:
        self.changes.note(ANY)

    def __reduce__(self):
        return dict, (dict(self),)


notes_edits(TrackedGroup, dict, ("__delitem__", "clear", "pop", "popitem"))
_LIST_EDITS = ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert",
               "pop", "remove", "clear", "sort", "reverse")
notes_edits(TrackedParams, list, _LIST_EDITS)
notes_edits(TrackedOption, list, _LIST_EDITS)


class TrackedGroups(list):
    """An optimizer's param groups, tracking the groups put in and noting `ANY` when groups
    are added, removed or replaced."""

    __slots__ = ("changes",)

    def __init__(self, groups, changes: GroupChanges):
        self.changes = changes
        super().__init__(map(self._tracked, groups))

    def _tracked(self, group) -> TrackedGroup:
        if isinstance(group, TrackedGroup) and group.changes is self.changes:
            return group
        return TrackedGroup(group, self.changes)

    def append(self, group) -> None:
        self.changes.note(ANY)
        super().append(self._tracked(group))

    def insert(self, index, group) -> None:
        self.changes.note(ANY)
        super().insert(index, self._tracked(group))

    def extend(self, groups) -> None:
        self.changes.note(ANY)
        super().extend([self._tracked(group) for group in groups])  # `groups` may be this list

    def __iadd__(self, groups):
        self.extend(groups)
        return self

    def __setitem__(self, index, value) -> None:
        self.changes.note(ANY)
        super().__setitem__(index, list(map(self._tracked, value)) if isinstance(index, slice)
                            else self._tracked(value))

    def _changed(self) -> None:
        self.changes.note(ANY)

    def __reduce__(self):
        return list, (list(self),)


notes_edits(TrackedGroups, list, ("__delitem__", "__imul__", "pop", "remove", "clear", "sort",
                                  "reverse"))


def tracked(groups: list, changes: GroupChanges) -> TrackedGroups:
    """`groups` as tracked groups that note into `changes` (the same list if they already do)."""
    if isinstance(groups, TrackedGroups) and groups.changes is changes:
        return groups
    changes.note(ANY)
    return TrackedGroups(groups, changes)
