"""`rooflm generate`, `rooflm chat` and their errors, run in-process through the real entry point."""
from __future__ import annotations

import io

from rooflm.cli import main

SMALL = ["--kv-cache-memory", "16M", "--show-progress", "false", "--max-tokens", "5"]


def test_generate_prints_each_completion(capsys):
    assert main(["generate", *SMALL, "The capital of France is", "One, two,"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2
    assert out[0].startswith("[0] 'The capital of France is' -> ") and "(length, 5 tokens)" in out[0]
    assert out[1].startswith("[1] 'One, two,' -> ")


def test_chat_streams_answers_until_exit(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("Say hi.\n\nName a fruit.\n/exit\nnever read\n"))
    assert main(["chat", *SMALL, "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("model> ") == 2  # the blank line is skipped, /exit ends the session


def test_bad_option_is_one_clear_line(capsys):
    assert main(["generate", "--block-size", "0", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "block_size=0" in err and "positive integer" in err


def test_bad_sampling_value_is_one_clear_line(capsys):
    assert main(["generate", "--top-p", "1.5", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert "top_p=1.5" in err and "(0, 1]" in err
