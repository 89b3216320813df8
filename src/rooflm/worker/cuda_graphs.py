"""CUDA graphs for decode steps at bucketed batch sizes.

A batch-1 decode step of a 7B model launches about 400 small kernels; launched one by one from Python their launch
gaps cost as much as the memory traffic itself. A CUDA graph records the whole forward once per batch-size bucket and
replays it with one launch.

How (the same recipe as vLLM's and gpt-fast's):
- the LM head is captured with the layers: ``run`` leaves the step's float32 logits in ``self.logits``;
- static input buffers sized for the largest bucket (token ids, positions, slots, query starts, context lengths and
  block tables up to ``max_model_len``); a step copies its real inputs into them, pads the rest of its bucket with
  harmless rows (token 0, slot -1 so no cache write, context length 0 so no attention read), replays and returns the
  first rows of the static output;
- one memory pool shared by every bucket's graph, captured largest first, so the buckets together need about the
  memory of the largest;
- each bucket runs eagerly twice before its capture: Triton compiles, and the GEMV dispatcher times its candidates
  (it never times inside a capture);
- only the Triton attention backend is captured: the reference backend synchronises with the host (it checks for -1
  slots) and so cannot be recorded. ``EngineConfig.enforce_eager`` turns all of this off.

The captured kernels read nothing host-side that changes between steps: decode attention takes its split count from
the bucket size and everything else from the device buffers (see ``kernels/decode_attention.py``).
"""
from __future__ import annotations

import bisect
import time

import torch

from rooflm.attention.backend import AttentionMetadata
from rooflm.logger import get_logger

logger = get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: the fixed ladder up to ``max_num_seqs`` (and including the next step above it)."""
    out = []
    for b in BUCKETS:
        out.append(b)
        if b >= max_num_seqs:
            break
    return out


def _attention_backends(model: torch.nn.Module) -> set[str]:
    return {getattr(m.backend, "name", "?") for m in model.modules() if hasattr(m, "backend")}


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_batch: int, max_blocks: int,
                 device: torch.device) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.device = device
        n = max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.logits: torch.Tensor | None = None  # after run(): [num_seqs, vocab] float32 of that step
        self.pool = None
        self.sizes: list[int] = []
        self.capture_seconds = 0.0
        self.replays = 0

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_blocks,  # not read by the decode path
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=[1] * bs,
        )

    def _forward(self, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs))
        return hidden, self.model.compute_logits(hidden)  # the LM head rides in the graph too

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        t0 = time.perf_counter()
        # Warm-up and capture on one side stream: a collective (tensor parallelism's all-reduce) first run on one
        # stream and then captured on another hangs the capture, and PyTorch recommends warming up off the default
        # stream anyway.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Dummy decode rows: context length 1, each reading (and writing) slot 0 of block 0, which the KV manager
        # has not handed out yet (capture runs before the first request); outputs are discarded.
        for bs in sorted(sizes, reverse=True):
            self.input_ids[:bs].zero_()
            self.positions[:bs].zero_()
            self.slot_mapping[:bs].fill_(-1)
            self.seq_lens[:bs].fill_(1)
            self.block_tables[:bs].zero_()
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile, tune and settle the allocator outside the capture
                    self._forward(bs)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                hidden, logits = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = (graph, hidden, logits)
        torch.cuda.synchronize(self.device)
        self.sizes = sorted(self.graphs)
        self.seq_lens.zero_()
        self.capture_seconds = time.perf_counter() - t0

    def can_run(self, meta: AttentionMetadata) -> bool:
        return (bool(self.sizes) and meta.is_decode_only and meta.num_tokens == meta.num_seqs
                and meta.num_seqs <= self.sizes[-1] and meta.block_tables.shape[1] <= self.max_blocks)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.num_seqs
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        w = meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :w].copy_(meta.block_tables, non_blocking=True)
        if bs > n:  # padding rows: no cache write, no attention read
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        graph, hidden, logits = self.graphs[bs]
        graph.replay()
        self.replays += 1
        self.logits = logits[:n]
        return hidden[:n]


def capture_decode_graphs(runner, max_num_seqs: int) -> DecodeGraphRunner | None:
    """Capture decode graphs for ``runner`` (a ``ModelRunner``); None when the model cannot be captured (CPU, a model
    whose step waits on the host (``cuda_graph_capturable = False``), or an attention backend other than Triton)."""
    if runner.device.type != "cuda":
        return None
    if not getattr(runner.model, "cuda_graph_capturable", True):
        logger.info("CUDA graphs off: %s synchronizes with the host during a step; decoding eagerly",
                    type(runner.model).__name__)
        return None
    backends = _attention_backends(runner.model)
    if backends != {"triton"}:
        logger.info("CUDA graphs off: attention backend %s cannot be captured (use attention_backend='triton')",
                    sorted(backends))
        return None
    # A sequence never holds more blocks than the pool has, nor more positions than the model takes.
    max_blocks = min(runner.num_blocks, -(-runner.cfg.max_position_embeddings // runner.block_size))
    sizes = batch_buckets(max_num_seqs)
    graph_runner = DecodeGraphRunner(runner.model, runner.kv_caches, max(sizes), max_blocks, runner.device)
    try:
        graph_runner.capture(sizes)
    except Exception as e:  # noqa: BLE001 - a failed capture must not take the engine down: run eagerly
        logger.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
        torch.cuda.synchronize(runner.device)
        return None
    logger.info("captured decode CUDA graphs for batch sizes %s in %.1f s", graph_runner.sizes,
                graph_runner.capture_seconds)
    return graph_runner
