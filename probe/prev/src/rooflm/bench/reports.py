"""The human reports of ``bench latency`` and ``bench throughput``: every figure in an adaptive unit
(``rooflm.units``), so a CPU run reads ``850 MB/s`` and ``12.3 tok/s`` and a GPU run ``1.93 TB/s`` and ``49,830 tok/s``.
The JSON/CSV outputs (``rooflm.bench.output``) keep the raw numbers in fixed units (seconds, GB/s, tok/s)."""
from __future__ import annotations

from rooflm.units import bandwidth, duration, flop_rate, rate, tok_rate


def _pct(x: float) -> str:
    return f"{x:.1%}" if x >= 0.001 else f"{x:.2g}"


def ceilings_line(c: dict) -> str:
    return f"  measured: copy {bandwidth(c['copy_gbps'] * 1e9)}, matmul {flop_rate(c['matmul_tflops'] * 1e12)}"


def profile_lines(profile: dict) -> list[str]:
    """The report lines of ``--profile``: GPU idle time between decode steps, per batch size."""
    lines = []
    for p in profile.values():
        head = f"  GPU idle between decode steps (batch {p['batch']}): "
        if not p["gaps"]:
            lines.append(head + "no consecutive steps with GPU work were found in the trace")
            continue
        lines.append(head + f"mean {duration(p['mean_us'] * 1e-6)}, median {duration(p['median_us'] * 1e-6)}, "
                     f"p90 {duration(p['p90_us'] * 1e-6)} over {p['gaps']} gaps "
                     f"({duration(p['step_wall_ms'] * 1e-3)} per step under the profiler)")
        for key, what in (("tables", "operator tables"), ("trace", "trace")):
            if key in p:
                lines.append(f"    {what}: {p[key]}")
    return lines


def latency_lines(r: dict) -> list[str]:
    from rooflm.roofline.live import roofline_line

    c = r["ceilings"]
    lines = [f"rooflm bench latency: {r['model']} {r['dtype']} batch={r['batch_size']} input={r['input_len']} "
             f"output={r['output_len']} on {c['device']} (attention {','.join(r['attention_backend'])}, "
             f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'})",
             ceilings_line(c),
             f"  engine init {duration(r['engine_init_s'])} (graph capture {duration(r['graph_capture_s'])}), "
             f"warm-up {duration(r['warmup_s'])}",
             f"  TTFT {duration(r['ttft_s'])}   TPOT {duration(r['tpot_s'])}   decode {tok_rate(r['decode_tok_s'])}   "
             f"end-to-end {tok_rate(r['e2e_tok_s'])}"]
    if "roofline" in r:
        rb = r["roofline"]
        lines.append(f"  roofline: TPOT >= {duration(rb['tpot_s'])} ({_pct(r['fraction_of_roofline_tpot'])} reached), "
                     f"TTFT >= {duration(rb['ttft_s'])} ({_pct(r['fraction_of_roofline_ttft'])} reached)")
        if "split_roofline" in r:
            sr = r["split_roofline"]
            lines.append(f"  over {sr['devices']} devices (bytes split evenly, collectives free): TPOT >= "
                         f"{duration(sr['tpot_s'])} ({_pct(r['fraction_of_split_roofline_tpot'])} reached)")
        if "expert_parallel_roofline" in r:
            er = r["expert_parallel_roofline"]
            lines.append(f"  experts split whole over {er['devices']} devices (each layer waits for the device whose "
                         f"experts the step touched most; collectives free): TPOT >= {duration(er['tpot_s'])} "
                         f"({_pct(r['fraction_of_expert_parallel_roofline_tpot'])} reached)")
        lines.append(f"  achieved {bandwidth(r['achieved_gbps'] * 1e9)} in decode = "
                     f"{_pct(r['fraction_of_copy_bandwidth'])} of the measured copy bandwidth; prefill "
                     f"{flop_rate(r['prefill_tflops'] * 1e12)} = {_pct(r['prefill_fraction_of_matmul_peak'])} of the "
                     "measured matmul peak")
    line = roofline_line(r.get("live_roofline"))
    if line:
        lines.append(f"  {line}")
    lines += profile_lines(r.get("profile", {}))
    if "hf" in r:
        h = r["hf"]
        lines.append(f"  transformers generate: TTFT {duration(h['ttft_s'])}  TPOT {duration(h['tpot_s'])}  "
                     f"decode {tok_rate(h['decode_tok_s'])}  end-to-end {tok_rate(h['e2e_tok_s'])}")
        lines.append(f"  speed-up: decode {r['speedup_decode']:.1f}x, end-to-end {r['speedup_e2e']:.1f}x "
                     f"(greedy tokens agree for the first {r['hf_greedy_tokens_agree_prefix']})")
    if "llama.cpp" in r:
        b = r["llama.cpp"]
        repack = "" if b["repack_buffers"] else ", repacking buffers off (the build crashed with them)"
        lines.append(f"  llama.cpp {b['version']} ({b['threads']} threads{repack}): TTFT {duration(b['ttft_s'])}  "
                     f"TPOT {duration(b['tpot_s'])}  decode {tok_rate(b['decode_tok_s'])}  end-to-end "
                     f"{tok_rate(b['e2e_tok_s'])}")
        lines.append(f"  rooflm / llama.cpp: decode {r['speedup_vs_llamacpp_decode']:.2f}x, end-to-end "
                     f"{r['speedup_vs_llamacpp_e2e']:.2f}x")
    return lines


def throughput_lines(res: dict) -> list[str]:
    from rooflm.roofline.live import roofline_line

    c = res["ceilings"]
    lines = [f"rooflm bench throughput: {res['model']} {res['dtype']} {res['num_prompts']} prompts x "
             f"({res['input_len']} in, {res['output_len']} out), max_num_seqs={res['max_num_seqs']}, on "
             f"{c['device']} (CUDA graphs {'on' if res['cuda_graphs'] else 'off'})",
             f"  {rate(res['requests_per_s'], 'requests/s')}, output {tok_rate(res['output_tok_s'])}, total "
             f"{tok_rate(res['total_tok_s'])} ({duration(res['elapsed_s'])}; engine init "
             f"{duration(res['engine_init_s'])})"]
    line = roofline_line(res.get("live_roofline"))
    if line:
        lines.append(f"  {line}")
    if "hf" in res:
        h = res["hf"]
        lines.append(f"  transformers generate ({h['num_prompts']} prompts, batches of {h['batch_size']}): "
                     f"{rate(h['requests_per_s'], 'requests/s')}, output {tok_rate(h['output_tok_s'])}; "
                     f"speed-up {res['speedup_output_tok_s']:.1f}x")
    return lines
