"""Byte quantities: parse what users type ("20GiB", "16 GB") and show bytes in binary units."""

from __future__ import annotations

import re

from memfit.errors import InvalidInputError

__all__ = ["format_bytes", "format_margin", "parse_bytes"]

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "k": KiB,
    "kib": KiB,
    "m": MiB,
    "mib": MiB,
    "g": GiB,
    "gib": GiB,
    "t": TiB,
    "tib": TiB,
}

_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts an integer count of bytes or a string such as ``"20GiB"``, ``"16 GB"``, ``"512MiB"``.
    ``GB`` means 10**9 and ``GiB`` 2**30, as on the spec sheets; a bare ``G`` is read as GiB.
    """
    if isinstance(value, bool):
        raise InvalidInputError(f"expected a number of bytes or a size such as '20GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidInputError(f"a size in bytes cannot be negative, got {value!r}")
        return value
    if isinstance(value, float):
        if value < 0 or value != value or value == float("inf"):
            raise InvalidInputError(f"a size in bytes must be a non-negative number, got {value!r}")
        if not value.is_integer():
            raise InvalidInputError(
                f"a size in bytes must be a whole number, got {value!r}; for a size in a unit write it as a string, "
                f"such as '{value:g}GiB'"
            )
        return int(value)
    if not isinstance(value, str):
        raise InvalidInputError(f"expected a number of bytes or a size such as '20GiB', got {value!r}")
    match = _PATTERN.match(value)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise InvalidInputError(
            f"could not read {value!r} as a size; use bytes or a number with a unit such as '20GiB', '512MiB' or '16GB'"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(num_bytes: int | None, precision: int = 2) -> str:
    """Show a byte count in binary units (``1.50 GiB``); ``None`` reads as ``unknown``."""
    if num_bytes is None:
        return "unknown"
    sign = "-" if num_bytes < 0 else ""
    size = float(abs(num_bytes))
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if size >= factor:
            return f"{sign}{size / factor:.{precision}f} {unit}"
    return f"{sign}{int(size)} B"


def format_margin(margin: float) -> str:
    """A share as people write it: ``0.025`` is ``2.5%`` (``{:.0%}`` would print a misleading ``2%``)."""
    return f"{round(margin * 100, 4):g}%"
