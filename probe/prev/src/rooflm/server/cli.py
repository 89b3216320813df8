"""``rooflm serve``: the OpenAI-compatible HTTP server. Standard-library imports only at the top (``rooflm --help``
stays fast); the server stack (fastapi, uvicorn, prometheus-client) is imported when the command runs."""
from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from rooflm.entrypoints.args import add_engine_args  # stdlib-only module: flags generated from EngineConfig

    add_engine_args(parser.add_argument_group("engine"))  # type: ignore[arg-type]
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=_port, default=8000,
                   help="port to listen on, 0-65535; 0 picks a free one (printed) (default: 8000)")
    g.add_argument("--api-key", default=os.environ.get("ROOFLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                        "(default: $ROOFLM_API_KEY; unset: no key)")
    g.add_argument("--served-model-name", default=None, help="model id shown in /v1/models (default: the model's)")
    g.add_argument("--max-waiting", type=int, default=512,
                   help="sequences that may wait beyond the --max-num-seqs running ones; a request that would "
                        "exceed it gets 503 at once (-1: unbounded; default: 512)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds in-flight requests get to finish; then streams end with an "
                        "error event; a second signal stops at once (default: 30)")
    g.add_argument("--max-request-body-mb", type=float, default=32.0,
                   help="largest request body in MiB; larger ones get 413 before they are read (default: 32)")
    g.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection gets to send a complete request head, else it is closed (default: 10)")
    g.add_argument("--body-timeout", type=float, default=30.0,
                   help="seconds a request body may stall between two pieces, else 408 (default: 30)")
    g.add_argument("--limit-concurrency", type=int, default=None,
                   help="most connections and requests at once; beyond, requests get 503 (default: no limit)")
    g.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json", "mistral"),
                   help="the format tool calls are written and read in: hermes (<tool_call> blocks), llama3_json "
                        "(the message is {\"name\", \"parameters\"}) or mistral ([TOOL_CALLS] [...]) "
                        "(default: the model's, from its chat template and vocabulary; hermes when they do not tell)")
    g.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level")


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0 picks a free one)")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /detokenize, /health, /metrics. See docs/serving.md.")
    add_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        from rooflm.server.launcher import run_server
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in ("fastapi", "uvicorn", "prometheus_client", "starlette", "pydantic"):
            raise SystemExit(f"rooflm serve needs the server extra ({e}): pip install 'rooflm[server]'") from None
        raise
    return run_server(args)
