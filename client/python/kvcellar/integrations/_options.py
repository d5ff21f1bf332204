"""Engine adapters' options: a frozen dataclass per adapter, parsed from the engine's extra-config
dict with one error that names every unknown or wrongly-typed key, at engine start.

A field's annotation decides its check: ``str``, ``Optional[str]``, ``int`` (an unsigned 32-bit
value) and ``bool``. Fields named ``prefetch_policy`` and ``write_policy`` must also name one of
the daemon's policies (kvcellar.client).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, Iterable, TypeVar

from ..client import PREFETCH_POLICIES, WRITE_POLICIES

T = TypeVar("T")

_POLICIES = {"prefetch_policy": PREFETCH_POLICIES, "write_policy": WRITE_POLICIES}


def _type_error(name: str, annotation: str, value: Any) -> str | None:
    if annotation in ("str", "Optional[str]"):
        if value is None and annotation == "Optional[str]":
            return None
        if not isinstance(value, str):
            return f"{name} (expected a str, got {type(value).__name__})"
        if value == "" and annotation == "Optional[str]":
            return f"{name} (must not be empty; leave it out for the default)"
        return None
    if annotation == "int":
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**32:
            return f"{name} (expected an int in [0, 2**32), got {value!r})"
        return None
    if annotation == "bool":
        if not isinstance(value, bool):
            return f"{name} (expected true or false, got {value!r})"
        return None
    raise TypeError(f"option {name}: unsupported annotation {annotation}")


def parse_options(cls: type[T], extra: Any, what: str, passthrough: Iterable[str] = ()) -> T:
    """``cls(**extra)`` after checking every key; ``passthrough`` keys belong to the engine and
    are skipped. Raises ValueError("<what>: ...") naming each bad key and the known ones."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"{what}: expected a dict, got {type(extra).__name__}")
    skip = set(passthrough)
    known = {f.name: str(f.type) for f in fields(cls)}
    mine = {k: v for k, v in extra.items() if k not in skip}
    unknown = sorted(set(mine) - set(known))
    if unknown:
        raise ValueError(f"{what}: unknown key(s) {unknown}; known: {sorted(known)}")
    bad = []
    for name, value in mine.items():
        err = _type_error(name, known[name], value)
        if err is None and name in _POLICIES and value not in _POLICIES[name]:
            err = (f"{name} ({value!r} is not one of "
                   f"{[p for p in _POLICIES[name] if p]})")
        if err is not None:
            bad.append(err)
    if bad:
        raise ValueError(f"{what}: " + "; ".join(bad))
    return cls(**mine)
