"""Figures for people: adaptive units and plain digits, never ``4.983e+04 tok/s`` or ``0 GB/s``.

Every function keeps three significant digits (more for large whole numbers, written with thousands separators) and
picks the unit that puts the number between 1 and 1000. Standard library only: the command's parser imports it."""
from __future__ import annotations

import math

__all__ = ["number", "rate", "tok_rate", "bandwidth", "flop_rate", "duration", "size"]


def number(x: float) -> str:
    """Three significant digits without an exponent: 0.0123, 1.23, 12.3, 123, 1,234, 12,345."""
    if x != x:  # NaN
        return "n/a"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    if x == 0:
        return "0"
    if abs(x) < 1000:
        x = float(f"{x:.3g}")  # round first, so 9.999 is 10.0, not 10.00
    a = abs(x)
    if a >= 1000:
        return f"{x:,.0f}"
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    decimals = 2 - math.floor(math.log10(a))  # three significant digits below 1
    return f"{x:.{decimals}f}"


def _scaled(x: float, steps: tuple[tuple[float, str], ...], unit: str) -> str:
    """``x`` in the largest prefix of ``steps`` (descending) that leaves it >= 1, else the last one."""
    if x != x or math.isinf(x) or x == 0:
        return f"{number(x)} {steps[-1][1]}{unit}"
    x = float(f"{x:.3g}")  # round first, so 999.7 MB/s is 1.00 GB/s
    for scale, prefix in steps:
        if abs(x) >= scale:
            break
    return f"{number(x / scale)} {prefix}{unit}"


_DECIMAL = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))


def rate(x: float, unit: str) -> str:
    """A count per second: below a million as plain digits (``49,830 tok/s``), above in M or G (``1.23M tok/s``)."""
    if abs(x) >= 1e6 and not math.isinf(x):
        value, prefix = _scaled(x, ((1e12, "T"), (1e9, "G"), (1e6, "M")), "").split(" ")
        return f"{value}{prefix} {unit}"
    return f"{number(x)} {unit}"


def tok_rate(x: float) -> str:
    """Tokens per second: ``12.3 tok/s``, ``49,830 tok/s``, ``1.23M tok/s``."""
    return rate(x, "tok/s")


def bandwidth(bytes_per_s: float) -> str:
    """Decimal bytes per second as hardware sheets give them: ``512 MB/s``, ``1.93 TB/s``."""
    return _scaled(bytes_per_s, _DECIMAL, "B/s")


def flop_rate(flops: float) -> str:
    """Operations per second: ``85.3 GFLOP/s``, ``312 TFLOP/s``."""
    return _scaled(flops, _DECIMAL, "FLOP/s")


def duration(seconds: float) -> str:
    """``12.3 ms``, ``850 µs``, ``4.20 s``, ``3 min 20 s``."""
    if seconds != seconds or math.isinf(seconds):
        return f"{number(seconds)} s"
    if seconds == 0:
        return "0 s"
    if abs(seconds) >= 120:
        minutes, rest = divmod(round(seconds), 60)
        return f"{minutes} min {rest} s"
    return _scaled(seconds, ((1.0, ""), (1e-3, "m"), (1e-6, "µ"), (1e-9, "n")), "s")


def size(nbytes: float) -> str:
    """Binary sizes as memory is sold: ``512 MiB``, ``13.5 GiB``."""
    steps = ((2.0**50, "Pi"), (2.0**40, "Ti"), (2.0**30, "Gi"), (2.0**20, "Mi"), (2.0**10, "Ki"), (1.0, ""))
    return _scaled(nbytes, steps, "B")
