"""Sizes read from the arrays that hold them, so a container never stores a size that could disagree."""

from __future__ import annotations


def axis_size(array: str, axis: int, doc: str) -> property:
    """A read-only property: the length of axis ``axis`` of the attribute named ``array``."""
    return property(lambda self: getattr(self, array).shape[axis], doc=doc)
