"""Machine-readable results of the benchmarks: ``--json PATH`` and ``--csv PATH``, where PATH ``-`` is stdout (then
the human report goes to stderr, so the stdout stream stays parseable; only one format may take stdout).

JSON holds the whole result dict. CSV holds one row per result (one per setting of ``bench perplexity``, one
otherwise): the scalar fields, nested dicts flattened with dots (``ceilings.copy_gbps``), lists left out (they are in
the JSON). Field names are stable: docs/benchmarks.md lists them. Standard library only (imported to build the
parser)."""
from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import sys
from typing import Any, Iterator, Sequence


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", default=None, metavar="PATH",
                   help="write every figure as JSON to PATH; '-': stdout, with the report on stderr (default: none)")
    p.add_argument("--csv", default=None, metavar="PATH",
                   help="write the figures as CSV (one row per result) to PATH; '-': stdout (default: none)")


def check_output_args(args: argparse.Namespace) -> None:
    """Fail before any work when both formats would go to stdout."""
    if getattr(args, "json", None) == "-" and getattr(args, "csv", None) == "-":
        raise ValueError("--json - and --csv -: only one format can go to stdout; give the other a file")


def machine_stdout(args: argparse.Namespace) -> bool:
    return "-" in (getattr(args, "json", None), getattr(args, "csv", None))


@contextlib.contextmanager
def report_stream(args: argparse.Namespace) -> Iterator[None]:
    """Inside: ``print`` goes to stderr when a machine format takes stdout, else to stdout."""
    if machine_stdout(args):
        with contextlib.redirect_stdout(sys.stderr):
            yield
    else:
        yield


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Scalar fields of ``d``, nested dicts as ``outer.inner``; lists and None-free structure left out."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        elif isinstance(value, (str, int, float, bool)) or value is None:
            out[name] = value
    return out


def to_csv(rows: Sequence[dict[str, Any]]) -> str:
    """CSV of flattened rows; the columns are the union of the rows' fields in first-seen order."""
    flat = [flatten(r) for r in rows]
    columns: list[str] = []
    for r in flat:
        columns.extend(k for k in r if k not in columns)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(flat)
    return buf.getvalue()


def _write(target: str, text: str) -> None:
    if target == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        sys.stdout.flush()
    else:
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)


def write_outputs(args: argparse.Namespace, result: dict[str, Any], rows: Sequence[dict[str, Any]] | None = None
                  ) -> None:
    """Write ``result`` as ``--json`` and ``rows`` (default: ``[result]``) as ``--csv``, where asked."""
    if getattr(args, "json", None):
        _write(args.json, json.dumps(result, indent=1, default=str))
    if getattr(args, "csv", None):
        _write(args.csv, to_csv(rows if rows is not None else [result]))


_ERROR_KINDS = {"ConnectError": "cannot connect", "ConnectTimeout": "connecting timed out",
                "ReadTimeout": "no answer in time", "WriteTimeout": "sending timed out",
                "PoolTimeout": "no free connection",
                "RemoteProtocolError": "the connection broke", "ReadError": "the connection broke",
                "JSONDecodeError": "the server sent invalid JSON"}


def describe_error(e: BaseException) -> str:
    """A failed request in words (``cannot connect: All connection attempts failed``), not an exception class."""
    kind = _ERROR_KINDS.get(type(e).__name__, "the request failed")
    return f"{kind}: {e}" if str(e) else kind
