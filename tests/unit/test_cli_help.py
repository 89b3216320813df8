"""Every option of every ``rooflm`` sub-command has help, and its help shows the default where there is one."""
from __future__ import annotations

import argparse

import pytest

from rooflm.cli import build_parser, main, shows_default


def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, path + (name,))
        elif not isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            yield parser, path, action


ACTIONS = list(_walk(build_parser(), ("rooflm",)))


def _id(item) -> str:
    _, path, action = item
    return " ".join(path[1:]) + " " + ("/".join(action.option_strings) or action.dest)


def test_every_command_is_walked():
    commands = {" ".join(path[1:]) for _, path, _ in ACTIONS}
    assert {"generate", "chat", "demo", "serve", "analyze", "quantize", "bench latency", "bench throughput",
            "bench serve", "bench perplexity"} <= commands


@pytest.mark.parametrize("item", ACTIONS, ids=[_id(x) for x in ACTIONS])
def test_option_has_help_and_shows_its_default(item):
    parser, _, action = item
    text = parser._get_formatter()._expand_help(action) if action.help else ""
    assert action.help and action.help.strip() and not action.help.strip().startswith("(default")
    if shows_default(action):
        assert "default" in text.lower()
    assert "(default: None)" not in text  # a None default is described in words, not printed


def test_formatted_help_prints_the_value_of_a_default():
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    text = sub.choices["generate"].format_help()
    assert "(default: 0.0)" in " ".join(text.split())  # --temperature, whose help does not mention it


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("rooflm ")
