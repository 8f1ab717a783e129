"""The rules every number a user gives a run obeys, in one place: the flags of every command
(cli/) and serve's TOML settings (serve/config.py) check their values here, so that a value is
taken or refused the same way wherever it is written.

Each rule returns the value in the unit the run uses (seconds, fractions) or raises OutOfBounds,
whose text says what the value should be; the caller puts the flag or the key before it.
"""

from __future__ import annotations

import math

# A sample costs QEMU more than this (QEMU-NOTES: ~0.1 ms on a gdbstub, ~1 ms over QMP): a
# shorter interval only piles up ticks the guest never runs between.
MIN_INTERVAL_MS = 0.1
# One run's guest run time at most: a day (for longer, qmpprof serve keeps a rolling window).
MAX_DURATION = 86400.0


class OutOfBounds(ValueError):
    """A number its rule refuses; the text says what it should be."""


def number(value: object) -> float:
    """A float from a flag's text or a TOML value (not a bool); OutOfBounds when there is none
    or it is not finite."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise OutOfBounds("a finite number")
    try:
        out = float(value)
    except (ValueError, OverflowError):
        raise OutOfBounds("a finite number") from None
    if not math.isfinite(out):
        raise OutOfBounds("a finite number")
    return out


def interval(ms: object, longest: float) -> float:
    """An interval given in milliseconds, in seconds: from MIN_INTERVAL_MS up to ``longest``
    seconds (a run's duration, or the longest interval serve's budget may ask for)."""
    value = number(ms)
    if not MIN_INTERVAL_MS <= value <= longest * 1e3:
        raise OutOfBounds(f"from {MIN_INTERVAL_MS:g} to {longest * 1e3:g} ms")
    return value / 1e3


def duration(seconds: object) -> float:
    """Guest run time to profile, in seconds: positive, at most MAX_DURATION."""
    value = number(seconds)
    if not 0 < value <= MAX_DURATION:
        raise OutOfBounds(f"more than 0 and at most {MAX_DURATION:g} seconds")
    return value


def jitter(fraction: object) -> float:
    value = number(fraction)
    if not 0 <= value < 1:
        raise OutOfBounds("a fraction in [0, 1)")
    return value


def overhead(percent: object) -> float:
    """A budget of the wall time the guest may stand stopped, in percent, as a fraction."""
    value = number(percent)
    if not 0 < value < 100:
        raise OutOfBounds("a percentage in (0, 100)")
    return value / 100


def address(text: str) -> int:
    """A guest address written in C's way (``0x...``, ``0o...``, decimal; ``_`` allowed), in
    (0, 2^64); OutOfBounds saying what it should be."""
    try:
        value = int(text.replace("_", ""), 0)
    except ValueError:
        raise OutOfBounds(f"not an address: {text!r}") from None
    if not 0 < value < 1 << 64:
        raise OutOfBounds(f"out of range: {text!r}")
    return value
