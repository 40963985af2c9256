"""Argument checks shared by every entry point of dta_ref and dta_fast: each returns the value in its
plain Python type or raises a TypeError / ValueError that names the argument."""

from __future__ import annotations

import math
import numbers

# Below this the logits / temperature of a float32 head overflow to inf for logits of ~1e18 and up,
# and softmax gives NaN: refused rather than computed.
MIN_TEMPERATURE = 1e-20


def as_float(value: numbers.Real) -> float:
    """A real number as a float, an int past float's range as an infinity (``float`` raises there), so
    that a check of finiteness refuses it with its own message."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_int(name: str, value, minimum: int, allow_none: bool = False) -> int | None:
    """``value`` as an int >= ``minimum`` (NumPy integers too; None passes when allowed)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int{' or None' if allow_none else ''}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def check_flag(name: str, value, allow_none: bool = False) -> bool | None:
    """``value`` as a bool (NumPy's too; None passes when allowed)."""
    if value is None and allow_none:
        return None
    if type(value).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{name} must be True, False{' or None' if allow_none else ''}, got {value!r}")
    return bool(value)


def check_real(name: str, value) -> float:
    """A finite real number, as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = as_float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_bytes(name: str, value, allow_zero: bool = False) -> int:
    """A finite, positive (or with ``allow_zero`` non-negative) number of bytes, as an int."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of bytes, got {type(value).__name__}")
    if not math.isfinite(as_float(value)) or value < 0 or (value == 0 and not allow_zero):
        kind = "non-negative" if allow_zero else "positive"
        raise ValueError(f"{name} must be a finite {kind} number of bytes, got {value}")
    return int(value)


def check_scale(scale, limit: float = math.inf) -> float:
    """An attention scale as a float: a real number, finite, at most ``limit`` in size."""
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number, got {type(scale).__name__}")
    value = as_float(scale)
    if not (math.isfinite(value) and abs(value) <= limit):
        bound = "" if limit == math.inf else f" and at most {limit:g} in size"
        raise ValueError(f"scale must be finite{bound}, got {scale}")
    return value


def check_temperature(temperature) -> float:
    """A sampling or scoring temperature: positive (at least MIN_TEMPERATURE) and finite."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (temperature >= MIN_TEMPERATURE and math.isfinite(as_float(temperature))):
        raise ValueError(f"temperature must be positive and finite (at least {MIN_TEMPERATURE:g}), got {temperature}")
    return float(temperature)


def check_tree(tree) -> None:
    """A PrefixTree, by type (``PrefixTree.validate`` checks its contents)."""
    from .tree import PrefixTree

    if not isinstance(tree, PrefixTree):
        raise TypeError(f"expected a PrefixTree, got {type(tree).__name__}")
