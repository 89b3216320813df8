"""CUDA graphs for decode steps at bucketed batch sizes.

A batch-1 decode step of a 7B model launches about 400 small kernels; launched one by one from Python their launch
gaps cost as much as the memory traffic itself. A CUDA graph records the whole forward once per batch-size bucket and
replays it with one launch.

How (the same recipe as vLLM's and gpt-fast's):
- the LM head is captured with the layers: ``run`` leaves the step's float32 logits in ``self.logits``;
- static input buffers sized for the largest bucket (token ids, positions, slots, query starts, context lengths and
  block tables up to ``max_model_len``); a step copies its real inputs into them and pads the rest of its bucket with
  harmless rows (slot -1 so no cache write, context length 0 so no attention read), all in one kernel
  (``rooflm/kernels/graph_inputs.py``), replays and returns the first rows of the static output;
- one memory pool shared by every bucket's graph, captured largest first, so the buckets together need about the
  memory of the largest;
- each bucket runs eagerly twice before its capture: Triton compiles, and the GEMV dispatcher times its candidates
  (it never times inside a capture);
- only the Triton attention backend is captured: the reference backend synchronises with the host (it checks for -1
  slots) and so cannot be recorded. ``EngineConfig.enforce_eager`` turns all of this off.

The captured kernels read nothing host-side that changes between steps: decode attention takes its split count from
the bucket size and everything else from the device buffers (see ``kernels/decode_attention.py``).

Speculative verify steps are captured too: a step in which every request scores the same number q of tokens (its last
token and q - 1 drafts; Leviathan et al. 2023) has the shape of a decode step with q rows per request, and the prefill
attention kernel takes its grid from q and the batch size alone. At batch 1 an eager verify step is bound by kernel
launches from the host (about three times a graph replay for a 7B model), which would hide what the roofline promises:
scoring k + 1 tokens costs about what scoring one does. Verify graphs are captured for q = 2 .. k + 1 at the batch
buckets up to ``VERIFY_MAX_BATCH`` (speculation pays at small batches; larger verify steps run eagerly), with the LM
head over every row. A step whose requests score different numbers of tokens, or a token tree, runs eagerly.
"""
from __future__ import annotations

import bisect
import time

import torch

from rooflm.attention.backend import AttentionMetadata
from rooflm.logger import get_logger

logger = get_logger(__name__)

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
VERIFY_MAX_BATCH = 8  # verify steps (q > 1 tokens per request) are captured up to this batch bucket


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


def uniform_query_len(meta: AttentionMetadata) -> int:
    """q when every sequence of the step has q new tokens and no token tree, else 0."""
    n, t = meta.num_seqs, meta.num_tokens
    if n == 0 or t != n * meta.max_query_len:  # the longest equals the mean only when all are equal
        return 0
    if meta.tree_masks is not None and any(m is not None for m in meta.tree_masks):
        return 0
    return meta.max_query_len


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], max_batch: int, max_blocks: int,
                 device: torch.device, max_query_len: int = 1) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.max_batch = max_batch
        self.max_blocks = max_blocks
        self.device = device
        n, t = max_batch, max_batch * max_query_len
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=device)
        self.positions = torch.zeros(t, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((t,), -1, dtype=torch.int64, device=device)
        # query starts per tokens-per-request q: a uniform step's are arange(0, n * q + 1, q), padding rows included,
        # so they are constant and nothing is copied into them
        self.query_starts: dict[int, torch.Tensor] = {}
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        # (batch bucket, tokens per request) -> (graph, hidden [bs * q, hidden], logits [bs * q, vocab])
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.logits: torch.Tensor | None = None  # after run(): [num_tokens, vocab] float32 of that step
        self.query_len = 1  # tokens per request of the last run
        self.pool = None
        self.sizes: list[int] = []  # the decode buckets
        self.verify_sizes: dict[int, list[int]] = {}  # q > 1 -> its batch buckets
        self.capture_seconds = 0.0
        self.replays = 0
        self.verify_replays = 0  # replays of graphs with q > 1 tokens per request

    def _meta(self, bs: int, q: int = 1) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[: bs * q],
            query_start_loc=self._query_starts(q)[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=q,
            max_seq_len=self.max_blocks,  # not read by the captured kernels
            query_start_loc_cpu=list(range(0, bs * q + 1, q)),
            seq_lens_cpu=[q] * bs,
        )

    def _query_starts(self, q: int) -> torch.Tensor:
        if q not in self.query_starts:
            self.query_starts[q] = torch.arange(0, self.max_batch * q + 1, q, dtype=torch.int32, device=self.device)
        return self.query_starts[q]

    def _forward(self, bs: int, q: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        t = bs * q
        hidden = self.model(self.input_ids[:t], self.positions[:t], self.kv_caches, self._meta(bs, q))
        return hidden, self.model.compute_logits(hidden)  # the LM head rides in the graph too

    @torch.inference_mode()
    def capture(self, sizes: list[int], verify: dict[int, list[int]] | None = None) -> None:
        """Capture a decode graph per batch bucket in ``sizes`` and a verify graph per (q, bucket) of ``verify``."""
        t0 = time.perf_counter()
        # Warm-up and capture on one side stream: a collective (tensor parallelism's all-reduce) first run on one
        # stream and then captured on another hangs the capture, and PyTorch recommends warming up off the default
        # stream anyway.
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Dummy decode rows: context length 1, each reading (and writing) slot 0 of block 0, which the KV manager
        # has not handed out yet (capture runs before the first request); outputs are discarded.
        shapes = [(bs * q, bs, q) for q, buckets in (verify or {}).items() for bs in buckets]
        shapes += [(bs, bs, 1) for bs in sizes]
        for _, bs, q in sorted(shapes, reverse=True):  # the largest first: the others fit in its pool
            t = bs * q
            self.input_ids[:t].zero_()
            self.positions[:t].zero_()
            self.slot_mapping[:t].fill_(-1)
            self.seq_lens[:bs].fill_(q)
            self.block_tables[:bs].zero_()
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile, tune and settle the allocator outside the capture
                    self._forward(bs, q)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                hidden, logits = self._forward(bs, q)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(bs, q)] = (graph, hidden, logits)
        torch.cuda.synchronize(self.device)
        self.sizes = sorted(bs for bs, q in self.graphs if q == 1)
        self.verify_sizes = {q: sorted(bs for bs, q2 in self.graphs if q2 == q) for q in sorted({q for _, q in
                                                                                              self.graphs if q > 1})}
        self.seq_lens.zero_()
        self.capture_seconds = time.perf_counter() - t0

    def release(self, sync: bool = True) -> None:
        """Destroy every captured graph; the runner then runs nothing (``can_run`` is False). Idempotent.
        ``sync``: wait for the device first (not after a peer failed: a collective of a graph may never finish)."""
        if sync and self.graphs:
            torch.cuda.synchronize(self.device)
        self.graphs.clear()
        self.sizes, self.verify_sizes, self.logits, self.pool = [], {}, None, None

    def _buckets(self, q: int) -> list[int]:
        return self.sizes if q == 1 else self.verify_sizes.get(q, [])

    def can_run(self, meta: AttentionMetadata) -> bool:
        q = uniform_query_len(meta)
        buckets = self._buckets(q) if q else []
        return bool(buckets) and meta.num_seqs <= buckets[-1] and meta.block_tables.shape[1] <= self.max_blocks

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph of the step's shape; returns the hidden states [num_tokens, hidden] and leaves the
        logits of every token in ``self.logits``."""
        n, q = meta.num_seqs, uniform_query_len(meta)
        buckets = self._buckets(q)
        bs = buckets[bisect.bisect_left(buckets, n)]
        from rooflm.kernels.graph_inputs import launch_stage, misfit, stage_inputs_ref  # (imports triton)

        t = n * q
        # the inputs into the graph's buffers, in one launch where they fit it (kernels/graph_inputs.py); padding
        # rows: no cache write, and a decode row reads no context, a verify row only its own keys
        src = (input_ids, positions, meta.slot_mapping, meta.seq_lens, meta.block_tables)
        dst = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_tables)
        stage = launch_stage if misfit(src, dst, n, q, bs) is None else stage_inputs_ref
        stage(src, dst, n, q, bs, 0 if q == 1 else q)
        graph, hidden, logits = self.graphs[(bs, q)]
        graph.replay()
        self.replays += 1
        self.verify_replays += q > 1
        self.query_len = q
        self.logits = logits[:t]
        return hidden[:t]


def verify_buckets(sizes: list[int], num_speculative_tokens: int) -> dict[int, list[int]]:
    """The verify graphs to capture: q = 2 .. k + 1 tokens per request at the decode buckets up to
    ``VERIFY_MAX_BATCH``."""
    small = [bs for bs in sizes if bs <= VERIFY_MAX_BATCH]
    return {q: small for q in range(2, num_speculative_tokens + 2)} if small else {}


def capture_decode_graphs(runner, max_num_seqs: int, num_speculative_tokens: int = 0) -> DecodeGraphRunner | None:
    """Capture decode graphs for ``runner`` (a ``ModelRunner``), and verify graphs for up to
    ``num_speculative_tokens`` drafts per request; None when the model cannot be captured (CPU, a model whose step
    waits on the host (``cuda_graph_capturable = False``), or an attention backend other than Triton)."""
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
    verify = verify_buckets(sizes, num_speculative_tokens)
    graph_runner = DecodeGraphRunner(runner.model, runner.kv_caches, max(sizes), max_blocks, runner.device,
                                     max_query_len=max(verify, default=1))
    try:
        graph_runner.capture(sizes, verify)
    except Exception as e:  # noqa: BLE001 - a failed capture must not take the engine down: run eagerly
        logger.warning("CUDA graph capture failed (%s: %s); decoding eagerly", type(e).__name__, e)
        torch.cuda.synchronize(runner.device)
        return None
    from rooflm.distributed import parallel_state as ps

    if ps.get_state() is not None:  # NCCL's teardown waits for the graphs that captured its collectives
        ps.before_leaving(lambda clean: graph_runner.release(sync=clean))
    logger.info("captured decode CUDA graphs for batch sizes %s%s in %.1f s", graph_runner.sizes,
                f" and verify graphs of {min(verify)}-{max(verify)} tokens per request up to batch "
                f"{max(verify[min(verify)])}" if verify else "", graph_runner.capture_seconds)
    return graph_runner
