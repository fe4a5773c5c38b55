"""What the containers that note their edits share (param groups and their lists in
_param_groups, optimizer state in _torch_state): each class's `_changed()` notes an edit in its
changes, `notes_edits` makes the named methods of its base call it before they run, and
`SetsThroughSetitem` routes a dict's setdefault, update and |= through the class's own
__setitem__ (dict's own skip a subclass's)."""
from __future__ import annotations


def notes_edits(cls, base, names) -> None:
    """Methods `names` of `cls`: `base`'s, each calling `self._changed()` before it runs."""
    for name in names:
        setattr(cls, name, _noting(getattr(base, name)))


def _noting(method):
    def changed(self, *args, **kwargs):
        self._changed()
        return method(self, *args, **kwargs)

    changed.__name__ = method.__name__
    return changed


class SetsThroughSetitem:
    """setdefault, update and |= through __setitem__ (a base put before dict)."""

    __slots__ = ()

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def __ior__(self, other):
        self.update(other)
        return self
