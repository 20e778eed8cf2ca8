"""understudy's version, the one place it is written besides ``pyproject.toml`` (a unit test
holds the two equal). A daemon puts it in its node record and its ``understudy_build_info``
metric; ``understudyd --version`` and ``understudy --version`` print it."""

from __future__ import annotations

import platform

VERSION = "0.1.0"


def describe(program: str) -> str:
    """``program``'s version line: ``understudyd 0.1.0 (Python 3.11.7)``."""
    return f"{program} {VERSION} (Python {platform.python_version()})"
