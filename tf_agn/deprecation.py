"""Renamed arguments keep their old name for one release, with a warning."""

import warnings


def renamed_argument(kwargs, old, new, owner, value):
    """Takes a deprecated argument out of `kwargs`, under its new name.

    Args:
        kwargs: the caller's `**kwargs`; `old` is removed from it.
        old: the argument's former name.
        new: its name now.
        owner: what takes it, for the message (e.g. "AGN").
        value: what the caller received under `new`.

    Returns:
        `kwargs[old]` if the caller was given it (after a
        `DeprecationWarning`), else `value`.
    """
    if old not in kwargs:
        return value
    warnings.warn(
        f"{owner}({old}=...) is deprecated and will be removed in the next "
        f"release; use {owner}({new}=...).",
        DeprecationWarning,
        stacklevel=3,
    )
    return kwargs.pop(old)
