"""Tensor and pipeline parallelism over two GPUs (NCCL): the same greedy tokens as one GPU. Skips without two CUDA
devices. float32 random weights of the default model's architecture, written once as a safetensors checkpoint that
every rank slices (random weights drawn per rank would differ between TP=1 and TP=2; a GPU machine need not have the
model package), on the default GPU path (Triton kernels, asynchronous scheduling), so a token can differ only where
two logits nearly tie; the logprobs are compared within 1e-3. Tensor parallelism with NCCL and with one-shot
all-reduces, and with its decode CUDA graphs (one-shot all-reduces captured); every worker must exit on the stop
message. Each multi-GPU engine runs in a new process, as under ``rooflm serve``: a process that set up peer-memory
all-reduces for one engine gives the next NCCL (PyTorch's symmetric-memory exchange is numbered per process)."""
from __future__ import annotations

import traceback

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two CUDA devices")

_g = torch.Generator().manual_seed(0)
PROMPTS = [torch.randint(0, 49152, (n,), generator=_g).tolist() for n in (5, 9, 17, 33, 64, 3)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """The default model's architecture with random weights (seeded), as a Hugging Face safetensors folder."""
    import json

    from safetensors.torch import save_file

    from rooflm.config import load_model_config
    from rooflm.loader import load_model

    folder = tmp_path_factory.mktemp("smollm2-random")
    (folder / "config.json").write_text(json.dumps(load_model_config("smollm2-135m").hf_config))
    model, _ = load_model("smollm2-135m", load_format="dummy", seed=3, show_progress=False)
    save_file({name: t.view().clone().contiguous() for name, t in model.weight_targets().items()},
              str(folder / "model.safetensors"))
    return str(folder)


def _generate(checkpoint: str, tp: int, pp: int = 1, dtype: str = "float32"):
    """Greedy tokens and logprobs of PROMPTS, and (for tp > 1) which paths rank 0's steps took: (one-shot
    all-reduces used, decode graphs replayed, Lamport kernels set up)."""
    from rooflm import LLM
    from rooflm.sampling_params import SamplingParams

    llm = LLM(checkpoint, dtype=dtype, tensor_parallel_size=tp, pipeline_parallel_size=pp, show_progress=False,
              kv_cache_memory=256 * 2**20, max_model_len=512)
    paths = None
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=1), use_tqdm=False)
        if tp > 1:  # rank 0 runs in this process: check which paths its steps took
            from rooflm.distributed.parallel_state import get_state

            one_shot = get_state().one_shot
            graphs = llm.engine.runner.graph_runner
            paths = (one_shot is not None and one_shot.calls > 0, graphs is not None and graphs.replays > 0,
                     one_shot is not None and one_shot.lamport is not None)
    finally:
        llm.shutdown()
    if tp * pp > 1:  # every worker left on the stop message; one terminated after the grace (a hung teardown) fails
        assert [p.exitcode for p in llm.engine.parallel.procs] == [0] * (tp * pp - 1)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], paths


def _child(checkpoint: str, tp: int, pp: int, dtype: str, engines: int, conn) -> None:
    try:
        conn.send(("ok", [_generate(checkpoint, tp, pp, dtype) for _ in range(engines)]))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _generate_fresh(checkpoint: str, tp: int, pp: int = 1, dtype: str = "float32", timeout_s: float = 600.0,
                    engines: int = 1):
    """``_generate`` in a new process (it inherits the environment), ``engines`` times one after the other (a list of
    their results when more than one); a run past ``timeout_s`` fails the test."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(checkpoint, tp, pp, dtype, engines, send))
    proc.start()
    send.close()
    if not recv.poll(timeout_s):
        proc.kill()
        proc.join()
        pytest.fail(f"tp={tp} pp={pp} {dtype}: no result within {timeout_s:.0f} s")
    status, value = recv.recv()
    proc.join(60)
    if status != "ok":
        pytest.fail(value)
    return value[0] if engines == 1 else value


@pytest.fixture(scope="module")
def one_gpu(checkpoint):
    return _generate(checkpoint, 1)[0]


@pytest.mark.parametrize("tp,pp,allreduce,graphs", [(2, 1, "nccl", "0"), (2, 1, "auto", "0"), (2, 1, "auto", "auto"),
                                                     (1, 2, "auto", "0")])
def test_two_gpus_give_the_greedy_tokens_of_one(checkpoint, one_gpu, tp, pp, allreduce, graphs, monkeypatch):
    # read by rank 0 and by the workers it spawns: NCCL or one-shot all-reduces; decode CUDA graphs off or automatic
    monkeypatch.setenv("ROOFLM_TP_ALLREDUCE", allreduce)
    monkeypatch.setenv("ROOFLM_TP_CUDA_GRAPHS", graphs)
    got, paths = _generate_fresh(checkpoint, tp, pp)
    if tp > 1:
        assert paths[:2] == (allreduce == "auto", graphs == "auto")
    for (ref_ids, ref_lp), (ids, lp) in zip(one_gpu, got):
        assert ids == ref_ids
        for a, b in zip(ref_lp, lp):
            assert max(abs(a[t] - b[t]) for t in a) <= 1e-3


def test_lamport_all_reduce_and_fused_norm_give_the_barrier_kernels_tokens_in_float16(checkpoint, monkeypatch):
    """float16 takes the Lamport kernels (all-reduce + residual add + RMSNorm in one launch, in CUDA graphs); the
    barrier kernel followed by the norm kernel sums in the same rank order, so only the norm's statistic (summed in
    another order) may differ: the same greedy tokens, logprobs within 1e-2."""
    monkeypatch.setenv("ROOFLM_TP_CUDA_GRAPHS", "auto")
    monkeypatch.setenv("ROOFLM_TP_ALLREDUCE", "triton")
    ref, paths = _generate_fresh(checkpoint, 2, dtype="float16")
    assert paths == (True, True, False)
    monkeypatch.setenv("ROOFLM_TP_ALLREDUCE", "auto")
    got, paths = _generate_fresh(checkpoint, 2, dtype="float16")
    assert paths == (True, True, True)
    for (ref_ids, ref_lp), (ids, lp) in zip(ref, got):
        assert ids == ref_ids
        for a, b in zip(ref_lp, lp):
            assert max(abs(a[t] - b[t]) for t in a) <= 1e-2


def test_a_second_engine_in_one_process_falls_back_to_nccl_and_gives_the_same_tokens(checkpoint, one_gpu,
                                                                                       monkeypatch):
    """The first TP=2 engine of a process takes the one-shot all-reduces; the second one in the same process (its
    workers fresh, rank 0's symmetric-memory count not) must notice that their exchange would never meet and use
    NCCL instead of hanging, with the same tokens, and both shut down cleanly."""
    monkeypatch.setenv("ROOFLM_TP_ALLREDUCE", "auto")
    monkeypatch.setenv("ROOFLM_TP_CUDA_GRAPHS", "0")
    (first, first_paths), (second, second_paths) = _generate_fresh(checkpoint, 2, engines=2)
    assert first_paths[0] and not second_paths[0]
    for got in (first, second):
        for (ref_ids, ref_lp), (ids, lp) in zip(one_gpu, got):
            assert ids == ref_ids
            for a, b in zip(ref_lp, lp):
                assert max(abs(a[t] - b[t]) for t in a) <= 1e-3
