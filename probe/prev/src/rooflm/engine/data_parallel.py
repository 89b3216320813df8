"""Data parallelism: N engine replicas behind one server, each request routed to one of them.

Each replica is a whole ``LLMEngine`` (its own copy of the weights, its own KV cache and scheduler) driven by its own
``AsyncLLMEngine`` thread; on CUDA replica ``i`` lives on ``cuda:i``. Replicas share nothing, so throughput scales
with their number as long as the host keeps up: the replicas' engine threads share one Python interpreter, which is
enough while a step's device time exceeds its host time (large models, GPUs) and not on a small CPU, where the
replicas also share the cores. vLLM runs its replicas as processes for the same reason at larger scale.

Routing (``DataParallelRouter``): a request goes to the replica with the least outstanding work, counted in
unfinished sequences (a request with ``n`` samples counts n). With prefix caching, a request whose prompt starts
like a recent one (the same first block of tokens) prefers the replica that served that one, since the shared blocks
are cached there (SGLang's cache-aware routing follows the same idea), unless that replica has ``affinity_slack``
more outstanding sequences than the least loaded one: locality never starves the other replicas.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from rooflm.engine.async_engine import AsyncLLMEngine, RequestStream
from rooflm.engine.stats import EngineStats
from rooflm.outputs import RequestOutput
from rooflm.sampling_params import SamplingParams


class DataParallelRouter:
    """Picks a replica per request. ``load(i)``: replica i's outstanding sequences. ``key_tokens``: how many leading
    prompt tokens identify a shared prefix (the KV block size: only whole blocks are shared). ``remember``: how many
    prefixes are remembered (least recently used forgotten first)."""

    def __init__(self, num_replicas: int, load: Callable[[int], int], *, prefix_affinity: bool = True,
                 key_tokens: int = 16, affinity_slack: int = 4, remember: int = 4096) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas!r} is invalid: expected at least 1")
        self.num_replicas = num_replicas
        self._load = load
        self.prefix_affinity = prefix_affinity
        self.key_tokens = key_tokens
        self.affinity_slack = affinity_slack
        self._remember = remember
        self._owner: collections.OrderedDict[Any, int] = collections.OrderedDict()

    def _key(self, prompt: str | Sequence[int]) -> Any:
        if isinstance(prompt, str):
            return prompt[: 4 * self.key_tokens] if len(prompt) >= 4 * self.key_tokens else None
        return tuple(prompt[: self.key_tokens]) if len(prompt) >= self.key_tokens else None

    def pick(self, prompt: str | Sequence[int]) -> int:
        loads = [self._load(i) for i in range(self.num_replicas)]
        least = min(range(self.num_replicas), key=lambda i: (loads[i], i))
        key = self._key(prompt) if self.prefix_affinity else None
        choice = least
        if key is not None:
            owner = self._owner.get(key)
            if owner is not None and loads[owner] - loads[least] <= self.affinity_slack:
                choice = owner
            self._owner[key] = choice
            self._owner.move_to_end(key)
            while len(self._owner) > self._remember:
                self._owner.popitem(last=False)
        return choice


def merge_stats(parts: Sequence[EngineStats]) -> EngineStats:
    """One snapshot of several replicas: counters and sizes summed, KV usage and the roofline fraction recomputed from
    the sums, per-bucket counts added."""
    if len(parts) == 1:
        return parts[0]
    out = EngineStats()
    for f in dataclasses.fields(EngineStats):
        vals = [getattr(p, f.name) for p in parts]
        first = vals[0]
        if isinstance(first, bool) or first is None or isinstance(first, str):
            setattr(out, f.name, next((v for v in vals if v is not None), first))
        elif isinstance(first, int):
            setattr(out, f.name, sum(vals))
        elif isinstance(first, float):
            setattr(out, f.name, sum(vals))
        elif isinstance(first, tuple) and f.name.endswith("_counts") and len({len(v) for v in vals}) == 1:
            setattr(out, f.name, tuple(sum(c) for c in zip(*vals)))
        else:
            setattr(out, f.name, first)
    total = out.num_total_blocks
    out.kv_usage = (total - out.num_free_blocks) / total if total else 0.0
    out.roofline_fraction = (out.roofline_predicted_s / out.roofline_measured_s
                             if out.roofline_measured_s > 0 else None)
    out.roofline_last_fraction = next((p.roofline_last_fraction for p in parts
                                       if p.roofline_last_fraction is not None), None)
    return out


class DataParallelEngine:
    """The ``AsyncLLMEngine`` interface the server uses, over several replicas (see the module docstring)."""

    def __init__(self, replicas: Sequence[AsyncLLMEngine], *, prefix_affinity: bool = True, key_tokens: int = 16,
                 affinity_slack: int = 4) -> None:
        if not replicas:
            raise ValueError("DataParallelEngine needs at least one replica")
        self.replicas = list(replicas)
        self.router = DataParallelRouter(len(self.replicas), lambda i: self.replicas[i].num_unfinished_sequences,
                                         prefix_affinity=prefix_affinity, key_tokens=key_tokens,
                                         affinity_slack=affinity_slack)
        self._where: dict[str, int] = {}  # unfinished request id -> replica index
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: Any, *, max_waiting: int | None = None) -> "DataParallelEngine":
        """Build ``config.data_parallel_size`` engines (loads the model that many times): on CUDA replica i on
        ``cuda:i``; on the CPU every replica on the CPU."""
        import torch

        from rooflm.engine.engine import LLMEngine, resolve_device

        n = config.data_parallel_size
        device = resolve_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"--data-parallel-size {n}: only {torch.cuda.device_count()} CUDA device(s) visible")
        replicas = []
        for i in range(n):
            dev = f"cuda:{i}" if device.type == "cuda" else str(device)
            replica_config = dataclasses.replace(config, data_parallel_size=1, device=dev)
            # each replica's admission limit is its share of the server's
            share = None if max_waiting is None else max(0, max_waiting // n)
            replicas.append(AsyncLLMEngine(LLMEngine(replica_config), max_waiting=share))
        return cls(replicas, prefix_affinity=config.enable_prefix_caching, key_tokens=config.block_size)

    # ------------------------------------------------------------------------------------------------ engine facts
    @property
    def engine(self) -> Any:
        return self.replicas[0].engine

    @property
    def tokenizer(self) -> Any:
        return self.replicas[0].tokenizer

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def max_model_len(self) -> int:
        return min(r.max_model_len for r in self.replicas)

    @property
    def max_num_seqs(self) -> int:
        """The most sequences one request may ask for (``n``): one replica runs all of a request's samples."""
        return min(r.max_num_seqs for r in self.replicas)

    @property
    def stats(self) -> EngineStats:
        return merge_stats([r.stats for r in self.replicas])

    @property
    def num_unfinished_requests(self) -> int:
        return sum(r.num_unfinished_requests for r in self.replicas)

    @property
    def is_running(self) -> bool:
        return all(r.is_running for r in self.replicas)

    @property
    def dead_error(self) -> BaseException | None:
        return next((r.dead_error for r in self.replicas if r.dead_error is not None), None)

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    # ------------------------------------------------------------------------------------------------ requests
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(prompt, params, request_id)
        async for out in self.iterate(stream):
            yield out

    async def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                          arrival_time: float | None = None) -> RequestStream:
        i = self.router.pick(prompt)
        request_id = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        self._where[request_id] = i  # before the add: an abort may come while the replica takes it
        try:
            return await self.replicas[i].add_request(prompt, params, request_id, arrival_time)
        except BaseException:
            self._where.pop(request_id, None)
            raise

    async def iterate(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        i = self._where.get(stream.request_id, 0)
        try:
            async for out in self.replicas[i].iterate(stream):
                yield out
        finally:
            self._where.pop(stream.request_id, None)

    def observe_first_token_delivery(self, request_id: str, seconds: float) -> None:
        i = self._where.get(request_id)
        if i is not None:
            self.replicas[i].observe_first_token_delivery(request_id, seconds)

    def abort(self, request_id: str) -> None:
        i = self._where.pop(request_id, None)
        if i is not None:
            self.replicas[i].abort(request_id)
