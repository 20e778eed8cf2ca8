"""Sizes in bytes written as people write them: ``27KB``, ``64MiB``, ``1GiB``, ``1.5GB``."""

from __future__ import annotations

import argparse

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """``27KB``, ``64MiB``, ``1GiB``, ``1.5GB``, ``1000`` -> bytes (units are case-blind).

    Raises:
        ValueError: not a number with one of those units, or not positive.
    """
    stripped = text.strip()
    number = stripped.rstrip("bBiIkKmMgG")
    try:
        value = float(number) * _UNITS[stripped[len(number):].upper()]
    except (ValueError, KeyError):
        raise ValueError(f"not a size: {text!r} (use a number of bytes, or one with KB, MB, "
                         "GB, KiB, MiB or GiB)") from None
    if not value > 0:
        raise ValueError(f"a size must be positive, got {text!r}")
    return int(value)


def size_arg(text: str) -> int:
    """:func:`parse_size` as an argparse ``type=``: its message, not argparse's generic one."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

