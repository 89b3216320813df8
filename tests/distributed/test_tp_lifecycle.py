"""Worker processes of a tensor-parallel engine: refused configurations, a worker killed between steps, shutdown."""
from __future__ import annotations

import json
import os
import signal

import pytest

from tp_helpers import TINY
from rooflm.config import EngineConfig
from rooflm.distributed.executor import WorkerDiedError
from rooflm.distributed.parallel_state import get_state
from rooflm.sampling_params import SamplingParams


@pytest.fixture
def tiny_config(tmp_path) -> str:
    """A config.json alone: random weights, quick to load in every rank."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


@pytest.mark.parametrize("tp", [0, -1, True, 1.5])
def test_bad_tensor_parallel_size_is_a_value_error_naming_it(tp):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=tp)


def test_unsplittable_model_is_refused_before_any_worker_starts(make_engine, tiny_config):
    import multiprocessing

    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="tensor_parallel_size=3"):  # 4 query heads, 1 KV head: 3 does not fit
        make_engine(model=tiny_config, load_format="dummy", tensor_parallel_size=3)
    assert multiprocessing.active_children() == before and get_state() is None


def test_a_worker_killed_between_steps_makes_the_next_step_raise(make_engine, tiny_config):
    engine = make_engine(model=tiny_config, load_format="dummy", tensor_parallel_size=2)
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine.add_request("a", [1, 2, 3, 4], params)
    engine.step()
    engine.step()
    (worker,) = engine.parallel.procs
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()  # dead before the next step: nothing races
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        engine.step()
    with pytest.raises(WorkerDiedError):  # the engine stays down
        engine.step()
    engine.abort_request("a")
    assert get_state() is None  # the group was left, so another engine may start


def test_shutdown_stops_every_worker_and_a_new_engine_can_start(make_engine, tiny_config):
    engine = make_engine(model=tiny_config, load_format="dummy", tensor_parallel_size=2)
    (worker,) = engine.parallel.procs
    engine.shutdown()
    assert worker.exitcode == 0 and get_state() is None
    engine.shutdown()  # idempotent
    again = make_engine(model=tiny_config, load_format="dummy", tensor_parallel_size=2)
    again.add_request("b", [5, 6], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    while again.has_unfinished_requests():
        again.step()


def test_a_preloaded_model_is_refused_under_tensor_parallelism(tiny_config):
    from rooflm.engine.engine import LLMEngine
    from rooflm.loader import load_model

    model, cfg = load_model(tiny_config, load_format="dummy", show_progress=False)
    with pytest.raises(ValueError, match="tensor_parallel_size=2"):
        LLMEngine(EngineConfig(model=tiny_config, load_format="dummy", tensor_parallel_size=2, device="cpu"),
                  model=model, model_config=cfg)


def test_a_one_rank_engine_beside_a_tensor_parallel_one_is_whole(make_engine, tiny_checkpoint):
    """The process group belongs to the engine that made it: a model built later in the same process at one rank
    holds every weight and never joins the group's collectives."""
    tp = make_engine(model=tiny_checkpoint, tensor_parallel_size=2)
    one = make_engine(model=tiny_checkpoint)
    assert (one.model.lm_head.out_features, tp.model.lm_head.out_features) == (131, 66)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    for engine in (one, tp, one):
        engine.add_request("x", [1, 2, 3], params)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert len(outs[-1].outputs[0].token_ids) == 6


@pytest.mark.parametrize("stubborn", [False, True])
def test_shutdown_aborts_the_group_when_a_worker_had_to_be_killed(stubborn, monkeypatch, tmp_path):
    """A worker that does not exit after the stop message is terminated; rank 0 then aborts its process group rather
    than tearing it down cleanly, which would wait for the dead peer forever (NCCL). A worker that exits on its own
    gets the clean teardown."""
    import multiprocessing
    import time

    from rooflm.distributed import executor as ex
    from rooflm.distributed import parallel_state as ps

    teardown: list[str] = []
    monkeypatch.setattr(ps, "destroy_distributed", lambda: teardown.append("destroy"))
    monkeypatch.setattr(ps, "abandon_distributed", lambda: teardown.append("abandon"))
    proc = multiprocessing.get_context("fork").Process(target=time.sleep if stubborn else int,
                                                         args=(60,) if stubborn else ())
    proc.start()
    executor = object.__new__(ex.MultiprocExecutor)
    executor.procs, executor.pipes, executor.error, executor._closed = [proc], [], None, False
    executor._store_dir = str(tmp_path / "store")
    executor.shutdown(timeout_s=0.2 if stubborn else 30.0)
    assert proc.exitcode == (-signal.SIGTERM if stubborn else 0)
    assert teardown == (["abandon"] if stubborn else ["destroy"])


def test_before_leaving_runs_each_release_once_before_the_group_is_left(monkeypatch):
    """Callbacks registered with before_leaving run once, with clean=True on destroy and False on abandon, before
    the process group is torn down; one that raises does not stop the others or the teardown."""
    import torch.distributed as dist

    from rooflm.distributed import parallel_state as ps

    from types import SimpleNamespace

    order = []
    monkeypatch.setattr(ps, "_BEFORE_LEAVING", [])
    monkeypatch.setattr(ps, "_STATE", SimpleNamespace(backend="gloo"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: order.append("destroy_process_group"))

    def failing(clean):
        order.append(("failing", clean))
        raise RuntimeError("boom")

    ps.before_leaving(failing)
    ps.before_leaving(lambda clean: order.append(("release", clean)))
    ps.destroy_distributed()
    assert order == [("failing", True), ("release", True), "destroy_process_group"]
    order.clear()
    ps.destroy_distributed()  # released already, and no group left
    assert order == []
    ps.before_leaving(lambda clean: order.append(("release", clean)))
    ps.abandon_distributed()  # no group: only the release
    assert order == [("release", False)]


def test_decode_graph_runner_release_drops_every_graph():
    """release() empties the runner (it then runs nothing) and is idempotent; it needs no device sync on the CPU."""
    import torch

    from rooflm.attention.metadata_utils import single_sequence_metadata
    from rooflm.worker.cuda_graphs import DecodeGraphRunner

    runner = DecodeGraphRunner(torch.nn.Identity(), [], max_batch=4, max_blocks=8, device=torch.device("cpu"))
    runner.graphs = {(1, 1): ("graph", None, None), (4, 1): ("graph", None, None), (4, 2): ("graph", None, None)}
    runner.sizes, runner.verify_sizes = [1, 4], {2: [4]}
    meta, _ = single_sequence_metadata(0, 1, 16)
    assert runner.can_run(meta)
    runner.release(sync=False)
    assert runner.graphs == {} and runner.sizes == [] and runner.verify_sizes == {}
    assert not runner.can_run(meta)
    runner.release()
    assert runner.graphs == {}


@pytest.mark.parametrize("failed", [False, True])
def test_an_nccl_group_is_left_by_a_local_abort(failed, monkeypatch):
    """NCCL's orderly teardown waits for every rank's, and an engine's ranks leave one after another: an NCCL group
    is aborted on both ways out (after the device finished its work on the orderly one), never destroyed; a gloo
    group is destroyed (its teardown is local)."""
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist

    from rooflm.distributed import parallel_state as ps

    calls = []
    monkeypatch.setattr(ps, "_BEFORE_LEAVING", [lambda clean: calls.append(("release", clean))])
    monkeypatch.setattr(ps, "_STATE", SimpleNamespace(backend="nccl", device="cuda:1"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda *a: calls.append("destroy"))
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda *a: calls.append("abort"),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    (ps.abandon_distributed if failed else ps.destroy_distributed)()
    want = [("release", not failed)] + ([] if failed else [("sync", "cuda:1")]) + ["abort"]
    assert calls == want and ps.get_state() is None
