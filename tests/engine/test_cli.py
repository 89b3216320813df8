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
    assert err.count("\n") == 0 and "--block-size 0: " in err and "positive integer" in err


def test_bad_sampling_value_is_one_clear_line(capsys):
    assert main(["generate", "--top-p", "1.5", "hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "rooflm generate: error: --top-p 1.5: expected a number in (0, 1]"


def _sigint_on_step(monkeypatch, at_step: int) -> list[int]:
    """Make the engine's ``at_step``-th step (counted from 1) deliver a SIGINT to this process, as a Ctrl-C would."""
    import signal

    from rooflm.engine.engine import LLMEngine

    calls = [0]
    original = LLMEngine.step

    def step(self):
        calls[0] += 1
        if calls[0] == at_step:
            signal.raise_signal(signal.SIGINT)
        return original(self)

    monkeypatch.setattr(LLMEngine, "step", step)
    return calls


def test_generate_prints_llama_cpp_style_timings(capsys):
    assert main(["generate", *SMALL, "The capital of France is"]) == 0
    err = capsys.readouterr().err
    assert "prompt eval time =" in err and "eval time =" in err and "tokens per second" in err
    assert "/     4 tokens" in err  # 5 generated: the first comes with the prompt evaluation


def test_ctrl_c_in_generate_prints_what_was_generated(capsys, monkeypatch):
    calls = _sigint_on_step(monkeypatch, 3)
    assert main(["generate", "--kv-cache-memory", "16M", "--show-progress", "false", "--max-tokens", "50",
                 "Once upon a time"]) == 130
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "(interrupted, " in out[0]
    generated = int(out[0].rsplit("(interrupted, ", 1)[1].split()[0])
    assert 0 < generated < 50 and calls[0] < 50


def test_ctrl_c_in_chat_stops_the_answer_not_the_session(capsys, monkeypatch):
    _sigint_on_step(monkeypatch, 2)
    monkeypatch.setattr("sys.stdin", io.StringIO("Tell me a long story.\nName a fruit.\n/exit\n"))
    assert main(["chat", "--kv-cache-memory", "16M", "--show-progress", "false", "--max-tokens", "40",
                 "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert out.count("model> ") == 2 and out.count("[stopped]") == 1


def test_threads_follow_the_cpus_this_process_may_use(monkeypatch):
    import os

    import torch

    from rooflm.entrypoints.args import available_cpus, set_compute_threads

    before = torch.get_num_threads()
    try:
        assert available_cpus() == len(os.sched_getaffinity(0))
        chosen = set_compute_threads(None)  # the probe may pick 1 on a busy machine
        assert chosen in (1, available_cpus()) and chosen == torch.get_num_threads()
        assert set_compute_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


def test_thread_choice_keeps_all_cpus_unless_fewer_are_faster():
    from rooflm.entrypoints.args import pick_threads

    assert pick_threads({2: 0.005, 1: 0.008}) == 2  # quiet machine: more threads
    assert pick_threads({2: 0.008, 1: 0.008}) == 2  # a tie keeps them
    assert pick_threads({2: 0.030, 1: 0.010}) == 1  # busy machine: the descheduled thread stalls every op
    assert pick_threads({2: 0.010, 1: 0.009}, margin=1.25) == 2  # a margin asks for a clear loss
    assert pick_threads({4: 0.02, 2: 0.01, 1: 0.012}) == 2


def test_bad_threads_value_is_one_line(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["generate", "--threads", "0", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--threads" in err


def test_version(capsys):
    import importlib.metadata

    import pytest

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"rooflm {importlib.metadata.version('rooflm')}"


def test_boolean_options_take_a_value_or_a_negation():
    import argparse

    from rooflm.entrypoints.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    base = ["--threads", "1"]
    assert engine_config_from_args(parser.parse_args(base)).enable_prefix_caching is True
    assert engine_config_from_args(parser.parse_args(base + ["--no-enable-prefix-caching"])).enable_prefix_caching \
        is False
    assert engine_config_from_args(parser.parse_args(base + ["--enable-prefix-caching", "off"])).enable_prefix_caching \
        is False
    assert engine_config_from_args(parser.parse_args(base + ["--enforce-eager"])).enforce_eager is True
    assert "--no-enforce-eager" in parser.format_help()
