"""One set of checks for every config field and merge parameter, with one message format.

Each check raises ``ValueError`` (or ``TypeError`` for a value of the wrong kind) naming the field exactly as the
user spells it, the value given and what is allowed. ``where`` prefixes the message with the context a bare field
name would not give, e.g. ``"merge_method 'ties'"`` for a recipe parameter.

Pure Python: imported by configs, registries and the merge methods, so it must stay cheap.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sized
from typing import Any


__all__ = [
    "Check",
    "boolean",
    "check_bool",
    "check_choice",
    "check_int",
    "check_length",
    "check_number",
    "check_pattern",
    "choice",
    "integer",
    "is_number",
    "number",
]

# A check bound to its constraints: ``check(name, value)`` raises or returns None.
Check = Callable[[str, Any], None]


def _prefix(name: str, where: str | None) -> str:
    return f"{where}: `{name}`" if where else f"`{name}`"


def is_number(value: Any) -> bool:
    """A real number (not a bool), finite."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _bounds(low, high, low_open, high_open) -> str:
    left = "(" if low_open or low is None else "["
    right = ")" if high_open or high is None else "]"
    return f"{left}{'-inf' if low is None else low}, {'inf' if high is None else high}{right}"


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    allow_none: bool = False,
    where: str | None = None,
) -> None:
    """``value`` is a finite number in the interval given by ``low``/``high`` (closed unless ``*_open``)."""
    if value is None and allow_none:
        return
    ok = is_number(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        none = " or None" if allow_none else ""
        raise ValueError(
            f"{_prefix(name, where)} must be a finite number in {_bounds(low, high, low_open, high_open)}{none}, "
            f"got {value!r}."
        )


def check_int(
    name: str,
    value: Any,
    *,
    low: int | None = None,
    high: int | None = None,
    allow_none: bool = False,
    where: str | None = None,
) -> None:
    """``value`` is an integer (not a bool) in ``[low, high]``."""
    if value is None and allow_none:
        return
    ok = isinstance(value, int) and not isinstance(value, bool)
    ok = ok and (low is None or value >= low) and (high is None or value <= high)
    if not ok:
        none = " or None" if allow_none else ""
        raise ValueError(
            f"{_prefix(name, where)} must be an integer in {_bounds(low, high, False, False)}{none}, got {value!r}."
        )


def check_choice(name: str, value: Any, allowed: Iterable[Any], *, where: str | None = None) -> None:
    """``value`` is one of ``allowed``."""
    allowed = list(allowed)
    try:
        ok = value in allowed
    except TypeError:  # an unhashable value against a set-like container
        ok = False
    if not ok:
        shown = ", ".join(repr(a) for a in allowed)
        raise ValueError(f"{_prefix(name, where)}={value!r} is not valid. Allowed values: {shown}.")


def check_bool(name: str, value: Any, *, allow_none: bool = False, where: str | None = None) -> None:
    """``value`` is ``True`` or ``False``."""
    if value is None and allow_none:
        return
    if not isinstance(value, bool):
        raise TypeError(f"{_prefix(name, where)} must be true or false, got {value!r}.")


def check_length(
    name: str, value: Any, length: int, *, allow_none: bool = True, where: str | None = None, of: str = ""
) -> None:
    """``value`` is a sequence of ``length`` items (``of`` says what the length counts, for the message)."""
    if value is None and allow_none:
        return
    if not isinstance(value, Sized) or isinstance(value, (str, bytes)) or len(value) != length:
        got = len(value) if isinstance(value, Sized) and not isinstance(value, (str, bytes)) else repr(value)
        what = f" (one per {of})" if of else ""
        raise ValueError(f"{_prefix(name, where)} must have {length} entries{what}, got {got}.")


def check_pattern(name: str, value: Any, *, allow_none: bool = True, where: str | None = None) -> None:
    """``value`` is a valid regular expression."""
    import re

    if value is None and allow_none:
        return
    if not isinstance(value, str):
        raise TypeError(f"{_prefix(name, where)} must be a regular expression string, got {value!r}.")
    try:
        re.compile(value)
    except re.error as e:
        raise ValueError(f"{_prefix(name, where)}={value!r} is not a valid regular expression: {e}.") from None


def _bound(check_fn: Callable[..., None], describe: str, *args: Any, parse: type | None = None, **kwargs) -> Check:
    """``check_fn`` with its constraints bound: ``check(name, value, where=None)``. ``check.describe`` says what is
    allowed (for docs); ``check.parse``, where set, is the number type a value written as a string is read as (a merge
    recipe's ``"1e-5"``, `hf_stable.registry.Field.parse`)."""

    def check(name: str, value: Any, where: str | None = None) -> None:
        check_fn(name, value, *args, where=where, **kwargs)

    check.describe = describe  # type: ignore[attr-defined]
    if parse is not None:
        check.parse = parse  # type: ignore[attr-defined]
    return check


def number(**bounds) -> Check:
    """A check for a number field, e.g. ``number(low=0, high=0.5, high_open=True)``."""
    interval = _bounds(
        bounds.get("low"), bounds.get("high"), bounds.get("low_open", False), bounds.get("high_open", False)
    )
    return _bound(check_number, interval, parse=float, **bounds)


def choice(*allowed: Any) -> Check:
    """A check for a choice field, e.g. ``choice("mean", "none")``."""
    return _bound(check_choice, " | ".join(repr(a) for a in allowed), allowed)


def integer(**bounds) -> Check:
    """A check for an integer field, e.g. ``integer(low=1, allow_none=True)``."""
    return _bound(check_int, _bounds(bounds.get("low"), bounds.get("high"), False, False), parse=int, **bounds)


def boolean(allow_none: bool = False) -> Check:
    """A check for a true/false field (``TypeError`` otherwise; a merge recipe reports it as a ``ValueError``)."""
    return _bound(check_bool, "true | false", allow_none=allow_none)
