"""The batch progress bar's speeds (fake clock) and the benchmarks' CSV flattening."""
from __future__ import annotations

import argparse
import csv
import io
import json

import pytest

from rooflm.bench import output
from rooflm.outputs import CompletionOutput, RequestOutput
from rooflm.progress import BatchProgress


def _out(prompt_len: int, *sample_lens: int) -> RequestOutput:
    outs = [CompletionOutput(i, "", [0] * n, finish_reason="length") for i, n in enumerate(sample_lens)]
    return RequestOutput("r", None, [1] * prompt_len, outs, finished=True)


def test_progress_speeds_count_prompt_and_every_sample():
    now = [100.0]
    buf = io.StringIO()
    bar = BatchProgress(3, file=buf, clock=lambda: now[0], mininterval=0)
    assert bar.speeds() == (0.0, 0.0)  # no time has passed
    now[0] = 102.0
    bar.finished(_out(1000, 40))
    assert bar.speeds() == (500.0, 20.0)
    now[0] = 104.0
    bar.finished(_out(3000, 10, 30))  # n=2: both samples' tokens
    assert bar.speeds() == (1000.0, 20.0)
    assert bar.postfix() == "est. speed input: 1,000 tok/s, output: 20.0 tok/s"
    bar.close()
    assert "2/3" in buf.getvalue() and "est. speed input" in buf.getvalue()


def test_flatten_keeps_scalars_and_dots_nested_names():
    d = {"a": 1, "b": {"c": 2.5, "d": {"e": "x"}}, "lst": [1, 2], "none": None, "flag": True}
    assert output.flatten(d) == {"a": 1, "b.c": 2.5, "b.d.e": "x", "none": None, "flag": True}


def test_csv_columns_are_the_union_in_first_seen_order():
    text = output.to_csv([{"setting": "none", "ppl": 3.5}, {"setting": "w8a16", "ppl": 3.6, "ratio": 1.03}])
    rows = list(csv.DictReader(io.StringIO(text)))
    assert text.splitlines()[0] == "setting,ppl,ratio"
    assert rows[1] == {"setting": "w8a16", "ppl": "3.6", "ratio": "1.03"} and rows[0]["ratio"] == ""


def test_write_outputs_to_stdout_and_files(tmp_path, capsys):
    res = {"x": 1.5, "nested": {"y": 2}, "series": [1, 2, 3]}
    args = argparse.Namespace(json="-", csv=str(tmp_path / "r.csv"))
    with output.report_stream(args):
        print("the report")
    output.write_outputs(args, res)
    captured = capsys.readouterr()
    assert json.loads(captured.out) == res and captured.err == "the report\n"
    assert (tmp_path / "r.csv").read_text() == "x,nested.y\n1.5,2\n"


def test_one_format_on_stdout():
    output.check_output_args(argparse.Namespace(json="-", csv="r.csv"))
    with pytest.raises(ValueError, match="only one format"):
        output.check_output_args(argparse.Namespace(json="-", csv="-"))
