"""/metrics exports the live roofline from the engine's stats snapshot: the overall fraction as a gauge and the
per-step fractions as a Prometheus histogram with cumulative buckets."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rooflm.config import load_model_config
from rooflm.engine.stats import EngineStats
from rooflm.roofline.hardware import get_hardware
from rooflm.roofline.live import FRACTION_BUCKETS, LiveRoofline
from rooflm.server.metrics import ServerMetrics


@dataclass
class _Engine:
    """What the metrics collector reads of the async engine."""

    stats: EngineStats = field(default_factory=EngineStats)
    num_unfinished_requests: int = 0
    is_running: bool = True


def _scrape(engine: _Engine) -> dict[str, dict[tuple, float]]:
    text = ServerMetrics(engine).render().decode()
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_not_measured_exports_no_roofline_series():
    m = _scrape(_Engine())
    assert "rooflm_engine_steps_total" in m
    assert not [k for k in m if "roofline" in k]


def test_roofline_gauge_and_cumulative_histogram_after_known_steps():
    live = LiveRoofline(load_model_config("llama-2-7b"), "float16", get_hardware("a6000"))
    fractions = [0.05, 0.33, 0.35, 0.72, 0.97, 0.99, 1.4]
    steps = [([1] * (i + 1), [100 * (i + 1)] * (i + 1), i + 1) for i in range(len(fractions))]
    for (q, c, rows), f in zip(steps, fractions):
        live.observe(q, c, rows, live.predict(q, c, rows) / f)
    engine = _Engine()
    live.fill_stats(engine.stats)
    m = _scrape(engine)

    assert m["rooflm_roofline_fraction"][()] == pytest.approx(live.fraction)
    buckets = {dict(k)["le"]: v for k, v in m["rooflm_step_roofline_fraction_bucket"].items()}
    assert len(buckets) == len(FRACTION_BUCKETS)
    for bound in FRACTION_BUCKETS:
        le = "+Inf" if bound == float("inf") else str(bound)
        assert buckets[le] == sum(f <= bound for f in fractions), le
    assert buckets["0.4"] == 3 and buckets["1.0"] == 6 and buckets["+Inf"] == len(fractions)
    assert m["rooflm_step_roofline_fraction_count"][()] == len(fractions)
    assert m["rooflm_step_roofline_fraction_sum"][()] == pytest.approx(sum(fractions))


def test_speculative_decoding_counters_after_known_verifications():
    engine = _Engine()
    m = _scrape(engine)
    assert not [k for k in m if "spec_decode" in k]  # no speculation: no series
    s = engine.stats
    s.spec_draft_tokens, s.spec_accepted_tokens, s.spec_verifications = 40, 30, 10
    m = _scrape(engine)
    assert m["rooflm_spec_decode_draft_tokens_total"][()] == 40
    assert m["rooflm_spec_decode_accepted_tokens_total"][()] == 30
    assert m["rooflm_spec_decode_verifications_total"][()] == 10
    assert m["rooflm_spec_decode_acceptance_rate"][()] == pytest.approx(0.75)
    assert m["rooflm_spec_decode_mean_accepted_length"][()] == pytest.approx(4.0)
