"""A single self-contained HTML report: inline SVG charts (roofline with every operator, time by operator) and the
per-operator tables. No scripts, no external files, no matplotlib: it opens in any browser."""
from __future__ import annotations

import math
from html import escape
from typing import Sequence

from rooflm.roofline.records import AnalysisResult, StageResult
from rooflm.roofline.report import gib, seconds, si

_COLORS = {"prefill": "#1f77b4", "decode": "#d62728"}
_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:17px;margin:24px 0 8px} .sub{color:#555;font-size:13px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:16px 0}
.card{border:1px solid #ddd;border-radius:6px;padding:8px 14px;min-width:120px;background:#f8f9fb}
.card b{display:block;font-size:18px} .card span{font-size:12px;color:#555}
table{border-collapse:collapse;font-size:12px;margin-bottom:8px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:right} th{background:#eef1f6}
td:first-child,th:first-child{text-align:left} tr.total td{font-weight:bold;background:#f4f4f4}
tr.model td:first-child{font-style:italic} .compute{color:#2a7d2a} .memory{color:#b03030} .comm{color:#8a5a00}
svg text{font-family:system-ui,sans-serif} .bad{color:#b03030;font-weight:bold}
"""


def _log_axis(lo: float, hi: float) -> tuple[float, float]:
    return math.floor(math.log10(lo)), math.ceil(math.log10(hi))


def roofline_svg(r: AnalysisResult, width: int = 760, height: int = 460) -> str:
    """Log-log roofline: one roof per compute dtype used, one point per operator and stage (hover for details)."""
    hw = r.hardware
    recs = [x for s in (r.prefill, r.decode) for x in s.layers if x.ops > 0 and x.memory_access > 0]
    ridge_max = max(hw.peak(k) for k in {x.compute_dtype for x in recs}) / hw.memory_bandwidth
    x0, x1 = _log_axis(min(x.arithmetic_intensity for x in recs) / 2,
                       max(max(x.arithmetic_intensity for x in recs), ridge_max) * 4)
    y0, y1 = _log_axis(min(x.performance for x in recs) / 2, max(hw.peak_ops.values()) * 2)
    L, R, T, B = 70, 20, 30, 50  # margins (px)

    def px(ai: float) -> float:
        return L + (math.log10(ai) - x0) / (x1 - x0) * (width - L - R)

    def py(perf: float) -> float:
        return height - B - (math.log10(perf) - y0) / (y1 - y0) * (height - T - B)

    out = [f'<svg id="roofline-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="roofline chart">',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">Roofline: {escape(r.model)} on '
           f'{escape(hw.name)}</text>']
    for e in range(x0, x1 + 1):
        X = px(10.0**e)
        out.append(f'<line x1="{X:.1f}" y1="{T}" x2="{X:.1f}" y2="{height - B}" stroke="#eee"/>'
                   f'<text x="{X:.1f}" y="{height - B + 16}" text-anchor="middle" font-size="11">1e{e}</text>')
    for e in range(y0, y1 + 1):
        Y = py(10.0**e)
        out.append(f'<line x1="{L}" y1="{Y:.1f}" x2="{width - R}" y2="{Y:.1f}" stroke="#eee"/>'
                   f'<text x="{L - 6}" y="{Y + 4:.1f}" text-anchor="end" font-size="11">1e{e}</text>')
    out.append(f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle" font-size="12">arithmetic intensity '
               f'(OPs/byte)</text><text x="16" y="{height / 2}" font-size="12" text-anchor="middle" '
               f'transform="rotate(-90 16 {height / 2})">attainable performance (OPs/s)</text>')
    lo_ai, hi_ai = 10.0**x0, 10.0**x1
    for i, key in enumerate(sorted({x.compute_dtype for x in recs})):
        peak = hw.peak(key)
        ridge = peak / hw.memory_bandwidth
        pts = f"{px(lo_ai):.1f},{py(lo_ai * hw.memory_bandwidth):.1f} {px(ridge):.1f},{py(peak):.1f} " \
              f"{px(hi_ai):.1f},{py(peak):.1f}"
        out.append(f'<polyline class="roof" points="{pts}" fill="none" stroke="#333" stroke-width="2"/>'
                   f'<text x="{px(hi_ai) - 4:.1f}" y="{py(peak) - 6 - 12 * i:.1f}" text-anchor="end" '
                   f'font-size="11">{key} {peak / 1e12:g} TOP/s, {hw.memory_bandwidth / 1e9:g} GB/s</text>')
    for x in recs:
        c = _COLORS.get(x.stage, "#555")
        shape = (f'<circle cx="{px(x.arithmetic_intensity):.1f}" cy="{py(x.performance):.1f}" r="4.5" fill="{c}" '
                 f'fill-opacity="0.75"' if x.stage == "prefill" else
                 f'<rect x="{px(x.arithmetic_intensity) - 4:.1f}" y="{py(x.performance) - 4:.1f}" width="8" '
                 f'height="8" fill="{c}" fill-opacity="0.75"')
        out.append(f'{shape} class="op"><title>{x.stage} {escape(x.name)}: intensity '
                   f'{x.arithmetic_intensity:.3g}, {si(x.performance)}OP/s, {x.bound}-bound</title>'
                   f'{"</circle>" if x.stage == "prefill" else "</rect>"}')
    for i, (stage, c) in enumerate(_COLORS.items()):
        out.append(f'<rect x="{L + 10}" y="{T + 8 + 16 * i}" width="10" height="10" fill="{c}"/>'
                   f'<text x="{L + 26}" y="{T + 17 + 16 * i}" font-size="11">{stage}</text>')
    out.append("</svg>")
    return "\n".join(out)


def breakdown_svg(r: AnalysisResult, width: int = 760) -> str:
    """Horizontal bars: share of prefill and decode-step time per operator (whole model)."""
    from rooflm.roofline.plot import time_shares  # pure Python helper; matplotlib is imported inside its plots only

    stages = {s: time_shares(r, s) for s in ("prefill", "decode")}
    names = list(stages["prefill"])
    bar, gap, L = 9, 6, 150
    height = 40 + len(names) * (2 * bar + gap) + 20
    out = [f'<svg id="time-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="time by operator">',
           f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fff"/>',
           f'<text x="{width / 2}" y="18" text-anchor="middle" font-size="14">Share of time by operator</text>']
    for j, (stage, c) in enumerate(_COLORS.items()):
        out.append(f'<rect x="{L + 180 * j}" y="26" width="10" height="10" fill="{c}"/>'
                   f'<text x="{L + 16 + 180 * j}" y="35" font-size="11">{stage} '
                   f'({seconds(sum(stages[stage].values()))})</text>')
    top = max((v / (sum(sh.values()) or 1.0) for sh in stages.values() for v in sh.values()), default=1.0) or 1.0
    y = 46
    for n in names:
        out.append(f'<text x="{L - 6}" y="{y + bar + 3}" text-anchor="end" font-size="11">{escape(n)}</text>')
        for stage, c in _COLORS.items():
            total = sum(stages[stage].values()) or 1.0
            share = stages[stage].get(n, 0.0) / total
            w = share / top * (width - L - 80)  # the largest share spans the chart
            out.append(f'<rect x="{L}" y="{y}" width="{w:.1f}" height="{bar}" fill="{c}"><title>{stage} '
                       f'{escape(n)}: {share:.1%}</title></rect>'
                       f'<text x="{L + w + 4:.1f}" y="{y + bar - 1}" font-size="9">{share:.1%}</text>')
            y += bar
        y += gap
    out.append("</svg>")
    return "\n".join(out)


def _stage_table(s: StageResult, layers: int) -> str:
    head = ("operator", "count", "OPs", "weights", "activations", "KV cache", "memory access", "intensity",
            "performance", "bound", "time (one)")
    rows = []
    for x in s.layers:
        rows.append(f'<tr class="{x.scope}"><td>{escape(x.name)}</td><td>{x.count}</td><td>{si(x.ops)}</td>'
                    f'<td>{si(x.load_weight)}</td><td>{si(x.load_act + x.store_act)}</td>'
                    f'<td>{si(x.load_kv + x.store_kv)}</td><td>{si(x.memory_access)}</td>'
                    f'<td>{x.arithmetic_intensity:.3g}</td><td>{si(x.performance)}</td>'
                    f'<td class="{x.bound}">{x.bound}</td><td>{seconds(x.time_s)}</td></tr>')
    t = s.totals
    rows.append(f'<tr class="total"><td>total ({layers} blocks + model)</td><td></td><td>{si(t.ops)}</td>'
                f'<td>{si(t.load_weight)}</td><td>{si(t.load_act + t.store_act)}</td>'
                f'<td>{si(t.load_kv + t.store_kv)}</td><td>{si(t.memory_access)}</td>'
                f'<td>{t.arithmetic_intensity:.3g}</td><td>{si(t.performance)}</td><td class="{t.bound}">{t.bound}'
                f'</td><td>{seconds(t.time_s)}</td></tr>')
    ths = "".join(f"<th>{h}</th>" for h in head)
    return f'<table id="table-{s.stage}" class="ops"><thead><tr>{ths}</tr></thead><tbody>{"".join(rows)}</tbody></table>'


def _sweep_table(results: Sequence[AnalysisResult]) -> str:
    head = ("w_bits", "batch", "prompt", "prefill", "decode step", "TTFT", "TPOT", "end-to-end", "tok/s", "memory",
            "fits")
    rows = "".join(
        f"<tr><td>{r.settings['w_bits']}</td><td>{r.request.batch}</td><td>{r.request.input_len}</td>"
        f"<td>{seconds(r.prefill_time_s)}</td><td>{seconds(r.decode_step_time_s)}</td><td>{seconds(r.request.ttft_s)}"
        f"</td><td>{seconds(r.request.tpot_s)}</td><td>{seconds(r.request.e2e_s)}</td>"
        f"<td>{r.request.throughput_tok_s:.4g}</td><td>{gib(r.memory.total)}</td>"
        f"<td>{'yes' if r.memory.fits else 'NO'}</td></tr>" for r in results)
    ths = "".join(f"<th>{h}</th>" for h in head)
    return f'<table id="table-sweep"><thead><tr>{ths}</tr></thead><tbody>{rows}</tbody></table>'


def html_report(results: Sequence[AnalysisResult]) -> str:
    """The report of ``results[0]`` (and a sweep table when there are several results)."""
    r = results[0]
    st, m, q, hw = r.settings, r.memory, r.request, r.hardware
    n = st["num_hidden_layers"]
    cards = [("TTFT", seconds(q.ttft_s)), ("TPOT", seconds(q.tpot_s)), ("end-to-end", seconds(q.e2e_s)),
             ("throughput", f"{q.throughput_tok_s:.4g} tok/s"), ("memory", f"{gib(m.total)} / {gib(m.device_memory)}"),
             ("fits", "yes" if m.fits else "NO")]
    mem_rows = "".join(f"<tr><td>{escape(k)}</td><td>{gib(v)}</td></tr>" for k, v in m.weights_breakdown.items())
    parts = [
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rooflm roofline: {escape(r.model)} on {escape(hw.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Roofline of {escape(r.model)} on {escape(hw.name)}</h1>",
        f'<div class="sub">batch {st["batch"]}, prompt {st["input_len"]}, generated {st["output_len"]}, decode step '
        f'at context {st["decode_context"]}; W{st["w_bits"]} A{st["a_bits"]} KV{st["kv_bits"]}; flash attention '
        f'{"on" if st["flash_attention"] else "off"}; tp {st["tp"]}. Device: {hw.memory_bandwidth / 1e9:g} GB/s, '
        f'{gib(hw.memory_bytes)}; source: {escape(hw.source or "-")}</div>',
        '<div class="cards">' + "".join(f'<div class="card"><span>{k}</span><b>{v}</b></div>' for k, v in cards)
        + "</div>",
        *(f'<p class="bad">{escape(x)}</p>' for x in r.notes),
        "<h2>Roofline</h2>", roofline_svg(r),
        "<h2>Time by operator</h2>", breakdown_svg(r),
    ]
    if len(results) > 1:
        parts += ["<h2>Sweep</h2>", _sweep_table(results)]
    parts += [
        f"<h2>Prefill ({st['batch']} x {st['input_len']} tokens)</h2>", _stage_table(r.prefill, n),
        f"<h2>Decode step (context {st['decode_context']})</h2>", _stage_table(r.decode, n),
        "<p class='sub'>Per-block rows are one transformer block (count = layers); times are per execution. "
        "Bytes are loaded + stored.</p>",
        "<h2>Memory per GPU</h2>",
        f'<table id="table-memory"><tbody>{mem_rows}<tr class="total"><td>weights</td><td>{gib(m.weights)}</td></tr>'
        f"<tr><td>KV cache ({m.kv_cache_tokens} tokens x {q.batch})</td><td>{gib(m.kv_cache)}</td></tr>"
        f"<tr><td>peak activations</td><td>{gib(m.peak_activation)}</td></tr>"
        f'<tr class="total"><td>total</td><td>{gib(m.total)}</td></tr></tbody></table>',
        "</body></html>",
    ]
    return "\n".join(parts)
