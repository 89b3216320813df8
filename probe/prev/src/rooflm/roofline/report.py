"""Text outputs: the terminal table (per operator and totals), the sweep table, CSV and JSON."""
from __future__ import annotations

import csv
import io
import json
from typing import Sequence

from rooflm.roofline.records import AnalysisResult, LayerRecord, StageResult, Totals
from rooflm.units import bandwidth, duration, flop_rate, tok_rate

_SI = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))


def si(x: float, digits: int = 3) -> str:
    """Engineering notation as Table 1 of Yuan et al. 2024 writes it: 68.7G, 67.1M, 1.25, 0 (3 significant digits)."""
    if x == 0:
        return "0"
    for scale, suffix in _SI:
        if abs(x) >= scale:
            return f"{x / scale:.{digits}g}{suffix}"
    return f"{x:.{digits}g}"


def seconds(t: float) -> str:
    """A time in the unit that suits it (``rooflm.units.duration``); an operator that takes none is ``0``."""
    return "0" if t == 0 else duration(t)


def gib(b: float) -> str:
    return f"{b / 2**30:.2f} GiB"


_COLS = ("operator", "OPs", "weights", "act", "KV", "mem access", "intensity", "performance", "bound", "time")


def _row(name: str, r: LayerRecord | Totals) -> list[str]:
    return [name, si(r.ops), si(r.load_weight), si(r.load_act + r.store_act), si(r.load_kv + r.store_kv),
            si(r.memory_access), f"{r.arithmetic_intensity:.3g}", si(r.performance), r.bound, seconds(r.time_s)]


def _grid(header: Sequence[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep, *(line(r) for r in rows)])


def stage_table(s: StageResult, layers: int) -> str:
    head = (f"{s.stage.capitalize()}: batch {s.batch}, "
            + (f"{s.q_len} prompt tokens" if s.stage == "prefill" else f"1 token attending to {s.context}"))
    rows = [_row(r.name, r) for r in s.layers if r.scope == "block"]
    rows.append(["-- model level (once) --", *[""] * 9])
    rows += [_row(r.name, r) for r in s.layers if r.scope == "model"]
    rows.append([f"total ({layers} blocks + model)", *_row("", s.totals)[1:]])
    note = (f"  per-block rows are one transformer block (x{layers}); weights/act/KV = bytes loaded+stored "
            f"of each kind; time = max(OPs/peak, bytes/bandwidth)")
    return "\n".join([head, _grid(_COLS, rows), note])


def text_report(r: AnalysisResult) -> str:
    st, hw, m, q = r.settings, r.hardware, r.memory, r.request
    peaks = ", ".join(f"{k} {flop_rate(v)}" for k, v in hw.peak_ops.items())
    out = [
        f"Roofline of {r.model} on {hw.name} ({bandwidth(hw.memory_bandwidth)}; peaks {peaks})",
        f"  W{st['w_bits']} A{st['a_bits']} KV{st['kv_bits']}, flash attention {'on' if st['flash_attention'] else 'off'}"
        f", tp {st['tp']}" + (" expert-parallel" if st.get("expert_parallel") else "")
        + (" (figures per GPU)" if st["tp"] > 1 else ""),
        "",
        stage_table(r.prefill, st["num_hidden_layers"]),
        "",
        stage_table(r.decode, st["num_hidden_layers"]),
        "",
        f"Memory per GPU: weights {gib(m.weights)} + KV cache {gib(m.kv_cache)} ({m.kv_cache_tokens} tokens x "
        f"{q.batch}) + peak activations {gib(m.peak_activation)} = {gib(m.total)} of {gib(m.device_memory)}: "
        + ("fits" if m.fits else "DOES NOT FIT"),
        f"Request ({q.batch} x {q.input_len} prompt + {q.output_len} generated): TTFT {seconds(q.ttft_s)}, "
        f"TPOT {seconds(q.tpot_s)}, end-to-end {seconds(q.e2e_s)}, {tok_rate(q.throughput_tok_s)} "
        f"(decode {tok_rate(q.decode_tok_s)}, prefill {tok_rate(q.prefill_tok_s)})",
    ]
    if r.prefill.totals.dequant_ops or r.decode.totals.dequant_ops:
        out.append(f"Dequantization (not in OPs): prefill {si(r.prefill.totals.dequant_ops)}, decode step "
                   f"{si(r.decode.totals.dequant_ops)} conversions")
    out += [f"Note: {n}" for n in r.notes]
    return "\n".join(out)


_SWEEP_COLS = ("w_bits", "batch", "input_len", "prefill", "decode step", "TTFT", "TPOT", "end-to-end", "tok/s",
               "memory", "fits", "prefill bound", "decode bound")


def sweep_table(results: Sequence[AnalysisResult]) -> str:
    rows = []
    for r in results:
        q, m = r.request, r.memory
        rows.append([r.settings["w_bits"], str(q.batch), str(q.input_len), seconds(r.prefill_time_s),
                     seconds(r.decode_step_time_s), seconds(q.ttft_s), seconds(q.tpot_s), seconds(q.e2e_s),
                     tok_rate(q.throughput_tok_s).removesuffix(" tok/s"), gib(m.total), "yes" if m.fits else "NO", r.prefill.totals.bound,
                     r.decode.totals.bound])
    first = results[0]
    head = (f"Sweep of {first.model} on {first.hardware.name}: A{first.settings['a_bits']} "
            f"KV{first.settings['kv_bits']}, output {first.settings['output_len']} tokens, flash attention "
            f"{'on' if first.settings['flash_attention'] else 'off'}, tp {first.settings['tp']}"
            + (" expert-parallel" if first.settings.get("expert_parallel") else ""))
    return head + "\n" + _grid(_SWEEP_COLS, rows)


CSV_FIELDS = ("model", "hardware", "w_bits", "a_bits", "kv_bits", "batch", "input_len", "decode_context", "stage",
              "scope", "count", "name", "ops", "load_weight", "load_act", "load_kv", "store_act", "store_kv",
              "bytes_loaded", "bytes_stored", "memory_access", "arithmetic_intensity", "performance", "bound",
              "time_s", "compute_dtype", "dequant_ops", "comm_bytes")


def to_csv(results: Sequence[AnalysisResult]) -> str:
    """One row per operator (and a ``total`` row per stage, scope "model", count 1) of every result."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in results:
        base = {"model": r.model, "hardware": r.hardware.key or r.hardware.name, **{
            k: r.settings[k] for k in ("w_bits", "a_bits", "kv_bits", "batch", "input_len", "decode_context")}}
        for s in (r.prefill, r.decode):
            for rec in s.layers:
                w.writerow({**base, **rec.__dict__})
            t = s.totals
            w.writerow({**base, **t.__dict__, "stage": s.stage, "scope": "total", "count": 1, "name": "total",
                        "compute_dtype": ""})
    return buf.getvalue()


def to_json(results: Sequence[AnalysisResult]) -> str:
    """One result: its ``to_dict()``; several (a sweep): ``{"schema", "results": [...]}``."""
    if len(results) == 1:
        return json.dumps(results[0].to_dict(), indent=2)
    return json.dumps({"schema": "rooflm.roofline.sweep/1", "results": [r.to_dict() for r in results]}, indent=2)
