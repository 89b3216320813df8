"""Adaptive units for the reports: no exponents, no zero figures in a too-large unit."""
from __future__ import annotations

import pytest

from rooflm import units


@pytest.mark.parametrize("x, text", [
    (0, "0"), (0.000123, "0.000123"), (0.5, "0.500"), (9.999, "10.0"), (12.34, "12.3"), (123.4, "123"),
    (1234.5, "1,234"), (49830.2, "49,830"), (-2.5, "-2.50"), (float("nan"), "n/a"),
])
def test_number(x, text):
    assert units.number(x) == text


@pytest.mark.parametrize("x, text", [
    (49830.2, "49,830 tok/s"), (12.34, "12.3 tok/s"), (0.25, "0.250 tok/s"), (4.9e6, "4.90M tok/s"),
    (2.5e9, "2.50G tok/s"),
])
def test_tok_rate(x, text):
    assert units.tok_rate(x) == text


@pytest.mark.parametrize("x, text", [
    (0.4e9, "400 MB/s"), (1.93e12, "1.93 TB/s"), (999.7e6, "1.00 GB/s"), (35e3, "35.0 kB/s"), (0, "0 B/s"),
])
def test_bandwidth(x, text):
    assert units.bandwidth(x) == text


@pytest.mark.parametrize("x, text", [
    (0.0123, "12.3 ms"), (8.5e-4, "850 µs"), (4.2, "4.20 s"), (200, "3 min 20 s"), (3e-9, "3.00 ns"),
    (0.9996, "1.00 s"),
])
def test_duration(x, text):
    assert units.duration(x) == text


def test_flop_rate_and_size():
    assert units.flop_rate(85.3e9) == "85.3 GFLOP/s" and units.flop_rate(312e12) == "312 TFLOP/s"
    assert units.size(13.5 * 2**30) == "13.5 GiB" and units.size(512 * 2**20) == "512 MiB"


@pytest.mark.parametrize("f", [units.tok_rate, units.bandwidth, units.flop_rate, units.duration, units.size])
@pytest.mark.parametrize("x", [3e-7, 0.04, 7.0, 5e4, 3e8, 6e11, 2e14])
def test_no_exponent_and_a_nonzero_leading_figure(f, x):
    text = f(x)
    assert "e+" not in text and "e-" not in text
    assert not text.startswith("0 ") and not text.startswith("0.00 ")
