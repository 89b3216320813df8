"""The roofline PNG's operator labels do not overlap (measured with matplotlib's renderer on a model with many
operators), and every operator is named."""
from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from matplotlib.text import Text  # noqa: E402

from rooflm.roofline import analyze, get_hardware  # noqa: E402
from rooflm.roofline.plot import _overlaps, place_labels, roofline_figure  # noqa: E402


def _boxes(fig):
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    anns = [t for t in ax.texts if t.get_text()]
    # Text's extent: the label itself (an Annotation's own extent also spans its leader line)
    return anns, [tuple(Text.get_window_extent(t, renderer).extents) for t in anns]


@pytest.mark.parametrize("model, batch", [("llama-2-7b", 1), ("llama-2-7b", 64), ("mixtral-8x7b", 8)])
def test_operator_labels_do_not_overlap(model, batch):
    import matplotlib.pyplot as plt

    r = analyze(model, get_hardware("a6000"), batch=batch, input_len=1024, output_len=16)
    fig = roofline_figure(r)
    try:
        anns, boxes = _boxes(fig)
        assert len(anns) >= 8
        clashes = [(anns[i].get_text(), anns[j].get_text()) for i in range(len(boxes)) for j in range(i)
                   if _overlaps(boxes[i], boxes[j])]
        assert clashes == []
        named = {n for a in anns for n in a.get_text().split(", ")}
        ops = {x.name for s in (r.prefill, r.decode) for x in s.layers if x.ops > 0 and x.memory_access > 0}
        assert named == ops
    finally:
        plt.close(fig)


def test_coincident_points_get_separate_spots():
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(1, 100)
    ax.set_ylim(1, 100)
    labels = [(10.0, 10.0, f"operator_{i}") for i in range(12)]  # all on one point: the worst case
    try:
        anns = place_labels(ax, labels)
        _, boxes = _boxes(fig)
        assert len(anns) == 12
        assert not any(_overlaps(boxes[i], boxes[j]) for i in range(12) for j in range(i))
        assert sum(a.arrow_patch is not None for a in anns) >= 8  # displaced ones point back at the spot
    finally:
        plt.close(fig)
