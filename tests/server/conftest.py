"""Fixtures of the server tests (helpers in server_helpers.py).

- ``fake_server`` / ``shared_fake_server``: the app in-process over the fake engine.
- ``real_server``: ``rooflm serve`` in a subprocess with the embedded default model (session-scoped; loading takes
  tens of seconds on a small CPU), with an API key.
- ``small_server``: ``rooflm serve`` running one sequence at a time with no waiting room, for the 503 and SIGTERM
  tests (started together with ``real_server`` so both load at once).

Every server started here is stopped at teardown.
"""
from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from server_helpers import (  # noqa: E402
    API_KEY,
    HAVE_REAL_ENGINE,
    REAL_ARGS,
    SMALL_ARGS,
    FakeServer,
    ServerProcess,
)

_prestarted: dict[str, ServerProcess] = {}


def _start_small() -> ServerProcess:
    return ServerProcess(*SMALL_ARGS)


@pytest.fixture
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    server.http.start()
    try:
        yield server
    finally:
        server.http.stop()


@pytest.fixture(scope="module")
def shared_fake_server() -> Iterator[FakeServer]:
    server = FakeServer()
    server.http.start()
    try:
        yield server
    finally:
        server.http.stop()


@pytest.fixture(scope="session")
def real_server() -> Iterator[ServerProcess]:
    if not HAVE_REAL_ENGINE:
        pytest.skip("rooflm.engine.engine is not there yet")
    server = ServerProcess(*REAL_ARGS, api_key=API_KEY)
    if "small" not in _prestarted:  # load the small server meanwhile: two loads in parallel on two cores
        _prestarted["small"] = _start_small()
    try:
        yield server.wait_ready()
    finally:
        server.stop()


@pytest.fixture
def small_server() -> Iterator[ServerProcess]:
    """A server running one sequence at a time with no waiting room. Tests may stop it (SIGTERM); the next test
    then gets a fresh one."""
    if not HAVE_REAL_ENGINE:
        pytest.skip("rooflm.engine.engine is not there yet")
    server = _prestarted.get("small")
    if server is None or not server.alive():
        server = _prestarted["small"] = _start_small()
    yield server.wait_ready()


@pytest.fixture(scope="session", autouse=True)
def _stop_prestarted() -> Iterator[None]:
    yield
    for server in _prestarted.values():
        server.stop()


@pytest.fixture(scope="module")
def hf(default_model_path):
    """transformers' model and tokenizer on the default GGUF, float32: the reference for log-likelihoods."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(default_model_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return model, tok
