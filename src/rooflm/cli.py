"""The ``rooflm`` command. Each sub-command lives with its concept and registers itself here:
a module named in ``_COMMAND_MODULES`` exposes ``register(subparsers)`` and imports only the standard library at its
top level, so ``rooflm --help`` stays fast; each command's ``func(args) -> int`` imports what it needs."""
from __future__ import annotations

import argparse
import importlib
import sys
import typing

_COMMAND_MODULES = (
    "rooflm.entrypoints.cli",  # generate, chat, demo
    "rooflm.roofline.cli",  # analyze
    "rooflm.server.cli",  # serve
    "rooflm.bench.cli",  # bench latency | throughput | serve
    "rooflm.quantization.cli",  # quantize
)


class _Parser(argparse.ArgumentParser):
    """A bad value is one line naming the flag and the value, then exit 2 (no usage block to scroll past)."""

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
        print(f"rooflm {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
