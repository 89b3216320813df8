"""PNG plots and the HTML report; the report is rendered in headless Chromium and screenshotted.

Chromium is required (the test is not skipped): ``apt-get install -y chromium`` (Debian/Ubuntu)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

from rooflm.roofline import analyze, sweep
from rooflm.roofline.html import html_report
from rooflm.roofline.plot import time_shares, write_plots

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


def _non_white_fraction(png: str) -> float:
    import matplotlib.image as mpimg

    img = mpimg.imread(png)  # float RGB(A) in [0, 1]
    rgb = img[..., :3]
    return float(((rgb < 0.9).any(axis=-1)).mean())


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("headless Chromium is needed for the HTML report test: apt-get install -y chromium")


def test_png_plots(tmp_path):
    r = analyze("llama-2-13b", "a6000", batch=1, input_len=1024, output_len=1)
    paths = write_plots([r], str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["roofline.png", "time_breakdown.png", "sweep.png"]
    for p in paths:
        assert _non_white_fraction(p) > 0.01, p


def test_time_shares_sum_to_stage_time():
    r = analyze("llama-2-7b", "a6000", batch=1, input_len=256, output_len=1)
    for stage in ("prefill", "decode"):
        assert sum(time_shares(r, stage).values()) == pytest.approx(r.stages[stage].time_s, rel=1e-12)


def test_html_report_renders_in_headless_chromium(tmp_path):
    results = sweep("llama-3-8b", "h100-sxm", batches=(1, 8), input_lens=(1024,), output_len=16)
    html = html_report(results)
    for external in ("<script", "<link", 'src="http', "href=", "url("):  # self-contained: nothing fetched
        assert external not in html, external
    page = tmp_path / "report.html"
    page.write_text(html)
    exe = _chromium()
    shot = tmp_path / "shot.png"
    with tempfile.TemporaryDirectory() as profile:
        flags = [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
        subprocess.run([exe, *flags, f"--screenshot={shot}", "--window-size=1280,2000", page.as_uri()],
                       capture_output=True, timeout=90, check=True)
    with tempfile.TemporaryDirectory() as profile:
        dom = subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                             capture_output=True, text=True, timeout=90, check=True).stdout
    assert shot.exists()
    assert _non_white_fraction(str(shot)) > 0.02  # charts, tables and text drawn, not a blank page
    for needle in ('id="roofline-chart"', 'id="time-chart"', 'id="table-prefill"', 'id="table-decode"',
                   'id="table-sweep"', "q_proj", "qk_matmul", "TTFT"):
        assert needle in dom, needle
    assert dom.count('class="op"') == sum(1 for s in (results[0].prefill, results[0].decode) for x in s.layers
                                          if x.ops > 0 and x.memory_access > 0)
