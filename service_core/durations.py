"""Durations as people type them on the command line: ``90d``, ``12h``, ``30m``."""

from __future__ import annotations

import re
from datetime import timedelta

_DURATION = re.compile(r"^\s*(\d+)\s*([dhm])\s*$")
_UNITS = {"d": "days", "h": "hours", "m": "minutes"}


def parse_duration(text: str) -> timedelta:
    """``90d``, ``12h`` or ``30m`` as a timedelta; ValueError for anything else (or zero)."""
    match = _DURATION.match(text)
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"expected a positive duration such as 90d, 12h or 30m, got {text!r}")
    return timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
