"""``python -m rooflm.server [options]``: the same as ``rooflm serve [options]``."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from rooflm.server.cli import _run, add_arguments

    parser = argparse.ArgumentParser(prog="python -m rooflm.server", description="rooflm serve")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"rooflm serve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
