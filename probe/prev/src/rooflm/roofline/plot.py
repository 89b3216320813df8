"""PNG plots (matplotlib, imported here only): the roofline with every operator as a point, the time breakdown by
operator, and a sweep curve like Figure 7 of Yuan et al. 2024 (decode time vs batch, one line per weight bit width) or
Figure 8 (prefill time vs prompt length)."""
from __future__ import annotations

import os
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Sequence

from rooflm.roofline.records import AnalysisResult

if TYPE_CHECKING:
    from rooflm.config import ModelConfig

FIG7_BATCHES = (1, 2, 4, 8, 16, 32, 64)
FIG7_W_BITS = ("16", "8", "4")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roofline_figure(r: AnalysisResult):
    """The log-log roofline figure: memory roof (bandwidth · intensity) up to each compute ceiling used; operators as
    points, one label per position (operators at the same point share it), placed so that no two labels overlap."""
    plt = _plt()
    hw = r.hardware
    fig, ax = plt.subplots(figsize=(8, 5.5))
    recs = [x for s in (r.prefill, r.decode) for x in s.layers if x.ops > 0 and x.memory_access > 0]
    lo = min(x.arithmetic_intensity for x in recs) / 2
    hi = max(max(x.arithmetic_intensity for x in recs) * 2, max(hw.peak_ops.values()) / hw.memory_bandwidth * 4)
    for key in sorted({x.compute_dtype for x in recs}):
        peak = hw.peak(key)
        ridge = peak / hw.memory_bandwidth
        ax.plot([lo, ridge, hi], [lo * hw.memory_bandwidth, peak, peak], lw=1.5, label=f"roof {key} ({peak / 1e12:g}T)")
    points: dict[tuple[float, float], list[str]] = defaultdict(list)
    for stage, marker in (("prefill", "o"), ("decode", "^")):
        pts = [x for x in recs if x.stage == stage]
        ax.scatter([x.arithmetic_intensity for x in pts], [x.performance for x in pts], marker=marker, s=28,
                   label=stage, zorder=3)
        for x in pts:
            names = points[(x.arithmetic_intensity, x.performance)]
            if x.name not in names:
                names.append(x.name)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (OPs/byte)")
    ax.set_ylabel("attainable performance (OPs/s)")
    ax.set_title(f"{r.model} on {hw.name}: batch {r.settings['batch']}, prompt {r.settings['input_len']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    place_labels(ax, [(x, y, ", ".join(names)) for (x, y), names in points.items()])
    return fig


def _overlaps(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _within(a: tuple[float, float, float, float], frame: tuple[float, float, float, float]) -> bool:
    return a[0] >= frame[0] and a[1] >= frame[1] and a[2] <= frame[2] and a[3] <= frame[3]


def place_labels(ax, labels: Sequence[tuple[float, float, str]], fontsize: float = 6, pad: float = 1.0) -> list:
    """Annotate each (x, y, text) near its point without two labels overlapping: each label takes the first free spot
    among right/left of its point and then ever further above and below it (a leader line joins a displaced label to
    its point). Greedy, in the order of the points' x (then y), which keeps labels near their points on a roofline,
    where points spread along the intensity axis. Returns the annotations."""
    fig = ax.figure
    fig.canvas.draw()  # the axes' final transform and a renderer to measure text with
    renderer = fig.canvas.get_renderer()
    px_per_pt = fig.dpi / 72.0
    gap = 2 * px_per_pt
    frame = tuple(ax.get_window_extent(renderer).extents)
    placed: list[tuple[float, float, float, float]] = []
    annotations = []
    for x, y, text in sorted(labels, key=lambda t: (t[0], t[1])):
        probe = ax.text(0, 0, text, fontsize=fontsize)
        box = probe.get_window_extent(renderer)
        probe.remove()
        w, h = box.width + pad, box.height + pad
        px, py = ax.transData.transform((x, y))
        chosen = None
        for inside in (True, False):  # inside the axes if there is room, anywhere otherwise
            for ring in range(500):
                step = ring * (h + gap)
                for dx, dy in ((gap, gap + step), (gap, -h - gap - step), (-w - gap, gap + step),
                               (-w - gap, -h - gap - step)):
                    cand = (px + dx, py + dy, px + dx + w, py + dy + h)
                    if inside and not _within(cand, frame):
                        continue
                    # a word's width apart sideways, so two labels on one row do not read as one
                    wide = (cand[0] - 3 * gap, cand[1], cand[2] + 3 * gap, cand[3])
                    if not any(_overlaps(wide, other) for other in placed):
                        chosen = (dx, dy, cand)
                        break
                if chosen:
                    break
            if chosen:
                break
        if chosen is None:
            raise ValueError(f"no free spot for the label {text!r} within 500 rows of its point")
        dx, dy, cand = chosen
        placed.append(cand)
        far = abs(dy) > h + 2 * gap  # displaced: a leader line shows which point the label names
        annotations.append(ax.annotate(
            text, (x, y), fontsize=fontsize, xytext=(dx / px_per_pt, dy / px_per_pt), textcoords="offset points",
            ha="left", va="bottom",
            arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5", shrinkA=0, shrinkB=2) if far else None))
    return annotations


def plot_roofline(r: AnalysisResult, path: str) -> str:
    plt = _plt()
    fig = roofline_figure(r)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def time_shares(r: AnalysisResult, stage: str) -> dict[str, float]:
    """Seconds per operator name over the whole model (count · time), largest first."""
    shares: dict[str, float] = defaultdict(float)
    for x in r.stages[stage].layers:
        shares[x.name] += x.count * x.time_s
    return dict(sorted(shares.items(), key=lambda kv: -kv[1]))


def plot_breakdown(r: AnalysisResult, path: str) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for ax, stage in zip(axes, ("prefill", "decode")):
        shares = time_shares(r, stage)
        names = list(shares)[::-1]
        total = sum(shares.values())
        ax.barh(names, [shares[n] * 1e3 for n in names], color="#4c72b0")
        ax.set_xlabel("time (ms, whole model)")
        ax.set_title(f"{stage}: {total * 1e3:.3g} ms")
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(f"Time by operator: {r.model} on {r.hardware.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_sweep(results: Sequence[AnalysisResult], path: str, x: str = "batch") -> str:
    """x="batch": decode-step time vs batch (Figure 7); x="input_len": prefill time vs prompt length (Figure 8).
    One line per weight bit width."""
    plt = _plt()
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in results:
        y = r.decode_step_time_s if x == "batch" else r.prefill_time_s
        lines[r.settings["w_bits"]].append((r.settings[x], y))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for w, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label="FP16" if w == "16" else f"W{w}")
    first = results[0]
    ax.set_xlabel("batch size" if x == "batch" else "prompt length (tokens)")
    ax.set_ylabel("decode step time (s)" if x == "batch" else "prefill time (s)")
    ctx = f"sequence length {first.settings['input_len']}" if x == "batch" else f"batch {first.settings['batch']}"
    ax.set_title(f"{first.model} on {first.hardware.name} ({ctx})")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure7_results(r: AnalysisResult, model: "str | ModelConfig | None" = None) -> list[AnalysisResult]:
    """The Figure 7 sweep of LLM-Viewer (Yuan et al. 2024) for ``r``'s model, device and prompt length: batches 1..64 x W16/W8/W4."""
    from rooflm.roofline.analyzer import sweep

    s = r.settings
    opts: dict[str, Any] = dict(output_len=1, a_bits=s["a_bits"], kv_bits=s["kv_bits"],
                                flash_attention=s["flash_attention"], tp=s["tp"], prefill_logits=s["prefill_logits"])
    return sweep(model or r.model, r.hardware, batches=FIG7_BATCHES, input_lens=(s["input_len"],),
                 w_bits_list=FIG7_W_BITS, **opts)


def write_plots(results: Sequence[AnalysisResult], out_dir: str, sweep_x: str = "batch",
                model: "str | ModelConfig | None" = None) -> list[str]:
    """roofline.png and time_breakdown.png of the first result; sweep.png of the results along ``sweep_x`` (or,
    when they do not vary along it, the Figure 7 sweep of the first result's model)."""
    os.makedirs(out_dir, exist_ok=True)
    first = results[0]
    paths = [plot_roofline(first, os.path.join(out_dir, "roofline.png")),
             plot_breakdown(first, os.path.join(out_dir, "time_breakdown.png"))]
    if len({r.settings[sweep_x] for r in results}) > 1:
        paths.append(plot_sweep(results, os.path.join(out_dir, "sweep.png"), sweep_x))
    else:
        paths.append(plot_sweep(figure7_results(first, model), os.path.join(out_dir, "sweep.png"), "batch"))
    return paths
