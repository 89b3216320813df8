"""A bad value is one line that names the flag, exit 2, and nothing loads: the checks run before the model does."""
from __future__ import annotations

import json

import pytest

from rooflm.cli import build_parser, flag_message, main


@pytest.fixture
def no_loading(monkeypatch):
    """Building an engine fails the test: the error must come before any weight is read."""
    def refuse(*args, **kwargs):
        raise AssertionError("the engine was built (weights would load)")

    monkeypatch.setattr("rooflm.llm.LLM.__init__", refuse)
    monkeypatch.setattr("rooflm.engine.engine.LLMEngine.__init__", refuse)
    monkeypatch.setattr("rooflm.entrypoints.args.set_compute_threads", lambda threads: 1)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "Traceback" not in err and "Error:" not in err  # no exception class names
    return err


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--temperature", "-1", "hi"], "rooflm generate: error: --temperature -1.0: expected a finite "
                                                "number >= 0"),
    (["generate", "--top-p", "2", "hi"], "--top-p 2.0: expected a number in (0, 1]"),
    (["chat", "--repetition-penalty", "0"], "--repetition-penalty 0.0: expected a finite number > 0"),
    (["generate", "--kv-cache-dtype", "bogus", "hi"], "--kv-cache-dtype 'bogus': expected one of"),
    (["demo", "--max-model-len", "0"], "--max-model-len 0: must be >= 1"),
])
def test_bad_values_name_the_flag(argv, expected, capsys, no_loading):
    assert main(argv) == 2
    assert expected in _one_line_error(capsys)


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["demo"]])
def test_max_model_len_beyond_the_named_config_fails_before_loading(command, capsys, no_loading):
    limit = 4096  # llama-2-7b's max_position_embeddings (rooflm/configs/llama-2-7b.json)
    assert main([command[0], "--model", "llama-2-7b", "--load-format", "dummy", "--max-model-len", str(limit + 1),
                 *command[1:]]) == 2
    err = _one_line_error(capsys)
    assert f"--max-model-len {limit + 1}: must be <= {limit}" in err and "llama-2-7b" in err


def test_max_model_len_is_read_from_a_checkpoint_config(tmp_path, capsys, no_loading):
    cfg = json.loads((__import__("importlib.resources").resources.files("rooflm") / "configs" /
                      "llama-2-7b.json").read_text())
    cfg["max_position_embeddings"] = 64
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["generate", "--model", str(tmp_path), "--max-model-len", "65", "hi"]) == 2
    assert "--max-model-len 65: must be <= 64" in _one_line_error(capsys)


def test_argparse_type_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--port", "http"])
    assert e.value.code == 2
    err = _one_line_error(capsys)
    assert err.startswith("rooflm serve: error: argument --port: 'http' is not a port number")


def test_messages_without_a_matching_flag_are_kept():
    parser = build_parser()
    args = parser.parse_args(["generate", "hi"])
    text = "SamplingParams.min_tokens=3 is invalid: expected at most max_tokens=2"
    assert flag_message(parser, args, text) == text  # generate has no --min-tokens
    assert flag_message(parser, args, "model='x' is missing") == "model='x' is missing"
    assert flag_message(parser, args, "SamplingParams.seed=1.5 is invalid: expected an integer or None") == \
        "--sample-seed 1.5: expected an integer or None"


@pytest.mark.parametrize("argv, expected", [
    (["analyze", "llama-2-7b", "--hardware", "a600"], "rooflm analyze: error: --hardware 'a600': unknown, expected "
                                                      "one of"),
    (["analyze", "llama-2-7b", "--w-bits", "3"], "--w-bits '3': expected one of 32, 16, bf16, 8, fp8, 4"),
    (["analyze", "llama-2-7b", "--batch", "0"], "--batch '0': expected an integer >= 1"),
])
def test_analyze_errors_name_the_flag(argv, expected, capsys):
    assert main(argv) == 2
    assert expected in _one_line_error(capsys)
