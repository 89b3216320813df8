"""The ``rooflm`` command. Each sub-command lives with its concept and registers itself here:
a module named in ``_COMMAND_MODULES`` exposes ``register(subparsers)`` and imports only the standard library at its
top level, so ``rooflm --help`` stays fast; each command's ``func(args) -> int`` imports what it needs."""
from __future__ import annotations

import argparse
import importlib
import re
import sys
import typing

_COMMAND_MODULES = (
    "rooflm.entrypoints.cli",  # generate, chat, demo
    "rooflm.roofline.cli",  # analyze
    "rooflm.server.cli",  # serve
    "rooflm.bench.cli",  # bench latency | throughput | serve
    "rooflm.quantization.cli",  # quantize
    "rooflm.spec_decode.cli",  # train-medusa
)


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the help already says what the default is (a default that
    depends on the machine or the model, written out in words)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if shows_default(action) and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text


def shows_default(action: argparse.Action) -> bool:
    """Whether an option has a default worth printing: a value it takes when not given (not a flag's off state)."""
    return bool(action.option_strings) and action.nargs != 0 and action.default not in (None, argparse.SUPPRESS)


class _Parser(argparse.ArgumentParser):
    """A bad value is one line naming the flag and the value, then exit 2 (no usage block to scroll past).
    Sub-command parsers are of this class too (argparse makes them with the parent's class), so all share the
    formatter."""

    def __init__(self, *args: typing.Any, **kwargs: typing.Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> "typing.NoReturn":
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rooflm")
    except PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rooflm", description="An LLM inference engine that knows its roofline.")
    parser.add_argument("--version", action="version", version=f"rooflm {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:  # a part not built yet, or an extra not installed
            if e.name and (e.name == name or name.startswith(e.name + ".")):
                continue
            raise
        module.register(sub)
    return parser


_FIELD_ERROR = re.compile(r"^(?:(EngineConfig|SamplingParams|SchedulerConfig|CacheConfig)\.)?(\w+)=(.*?) is "
                          r"(invalid|unknown): (.*)$", re.S)


def _command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub-)parser that parsed ``args``: ``rooflm bench latency`` -> the latency parser."""
    for dest in ("command", "bench_command"):
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        name = getattr(args, dest, None)
        if sub is None or name not in sub.choices:
            break
        parser = sub.choices[name]
    return parser


def flag_message(parser: argparse.ArgumentParser, args: argparse.Namespace, message: str) -> str:
    """A config's ``SamplingParams.temperature=-1.0 is invalid: expected ...`` (or an analyzer's ``w_bits='3' is
    invalid: ...``) as ``--temperature -1.0: expected ...`` when the command has that flag, so the message names
    what the user typed."""
    m = _FIELD_ERROR.match(message)
    if not m:
        return message
    cls, field, value, what, rest = m.groups()
    options = {a.dest: a.option_strings for a in _command_parser(parser, args)._actions if a.option_strings}
    # a request's sampling options may share a name with an engine option (seed): theirs are prefixed sampling_
    flags = options.get(f"sampling_{field}") if cls == "SamplingParams" else None
    flags = flags or options.get(field)
    if not flags:
        return message
    return f"{max(flags, key=len)} {value}: {'unknown, ' if what == 'unknown' else ''}{rest}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `rooflm analyze ... | head`
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, FileNotFoundError) as e:  # user errors: one clear line, no traceback
        command = " ".join(x for x in (args.command, getattr(args, "bench_command", None)) if x)
        print(f"rooflm {command}: error: {flag_message(parser, args, str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
