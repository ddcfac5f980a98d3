"""The one rule for reading a figure that may be missing or malformed (a metrics.csv cell, a stats value
from the wire, a summary field): a finite float, or None."""

from __future__ import annotations

import math
from typing import Any


def finite_float(value: Any) -> float | None:
    """A finite float from a number or a numeric string; None for None, "", booleans, NaN, infinities and
    anything else."""
    if value is None or value == "" or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None
