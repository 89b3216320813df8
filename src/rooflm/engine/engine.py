"""LLMEngine: requests in, one scheduler step + one forward pass per ``step()``, outputs out.

The step contract (see docs/architecture.md): ``Scheduler.schedule()`` -> ``SchedulerOutput`` (diffs) ->
``ModelRunner.execute()`` -> ``StepHandle`` -> ``Scheduler.update_from_output()`` -> ``EngineCoreOutput``s ->
``OutputProcessor.process()`` -> ``RequestOutput``s.

Asynchronous scheduling (``async_scheduling``): ``step()`` schedules and launches step N+1 *before* it waits for
step N, so the host's scheduling and input preparation overlap the device's forward pass. The token sampled in
step N feeds step N+1 on the device; the host reads it one step later for outputs and stop checks, and whatever a
request computed after its stop condition is dropped, so outputs equal the synchronous mode's.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

import torch

from rooflm.attention.kv_quant import kv_storage_dtype
from rooflm.config import EngineConfig, ModelConfig
from rooflm.engine.output_processor import OutputProcessor
from rooflm.engine.request import Request
from rooflm.engine.sched_output import SchedulerOutput
from rooflm.engine.scheduler import FINISH_ABORT, Scheduler
from rooflm.engine.stats import EngineStats
from rooflm.engine.stop_checker import FINISH_STOP
from rooflm.kv_cache import KVCacheManager
from rooflm.logger import get_logger
from rooflm.outputs import RequestMetrics, RequestOutput
from rooflm.sampling_params import SamplingParams
from rooflm.worker.model_runner import ModelRunner, StepHandle, kv_bytes_per_block, profile_activation_bytes

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_KV_DEFAULT = 512 * 2**20  # bytes of KV pool on the CPU unless told otherwise
_CUDA_GRAPH_RESERVE = 512 * 2**20  # room left for the decode graphs' memory pool and allocator slack


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device={device!r} is invalid: expected 'auto', 'cpu' or 'cuda[:N]'") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} asked for, but CUDA is not available here")
    return dev


def _kv_dtype_text(kv_cache_dtype: str, storage: torch.dtype) -> str:
    """How the log names the cache's element type: "bfloat16", or "int8 + per-token scales" when quantized."""
    name = str(storage).removeprefix("torch.")
    return name if kv_cache_dtype == "auto" else f"{name} + per-token scales"


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model: torch.nn.Module | None = None,
                 model_config: ModelConfig | None = None, tokenizer: Any = None, **kwargs: Any) -> None:
        """Load ``config.model`` (or serve an already loaded ``model`` with its ``model_config`` and ``tokenizer``,
        e.g. one shared by several engines)."""
        from rooflm.loader import load_model
        from rooflm.tokenizer import load_tokenizer

        self.config = config = config or EngineConfig(**kwargs)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        if model is None:
            model, model_config = load_model(
                config.model, load_format=config.load_format, dtype=self.dtype, device=self.device,
                attn_backend=config.attention_backend, ops=config.ops, seed=config.seed,
                show_progress=config.show_progress, quantization=config.quantization)
            if config.load_format != "dummy" or config.tokenizer:
                tokenizer = load_tokenizer(config.tokenizer or config.model)
        elif model_config is None:
            raise ValueError("model_config is required with a preloaded model")
        self.model, self.model_config = model.eval(), model_config
        self.tokenizer = tokenizer
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        cfg = self.model_config

        # The live roofline: each step's best possible time on this device's measured ceilings (measured before the
        # KV pool takes the memory the measurement needs).
        from rooflm.roofline.live import LiveRoofline

        from rooflm.quantization.apply import weight_format

        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype)  # the cache's element type
        # a quantized model's bound is for the bytes its packed weights (and its cache) really take
        self.roofline = LiveRoofline.for_engine(cfg, self.dtype, self.device, kv_dtype=self.kv_dtype,
                                                weight_format=weight_format(self.model))
        num_blocks = self._num_blocks(cfg)
        from rooflm.kv_cache.compression import KVCompressionConfig

        self.kv_compression = KVCompressionConfig.parse(config.kv_compression)
        if self.kv_compression is not None:
            self.kv_compression.check(config.block_size)
        self.max_model_len = self._max_model_len(cfg, num_blocks)
        self.eos_token_ids = self._eos_ids(cfg)
        self.scheduler_config = config.scheduler_config(self.max_model_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.eos_token_ids)
        self.scheduler.compression = self.kv_compression
        self.runner = ModelRunner(self.model, cfg, num_blocks, config.block_size, self.device, self.dtype,
                                  config.max_num_seqs, self.max_model_len, self.eos_token_ids,
                                  kv_cache_dtype=config.kv_cache_dtype)
        self.output_processor = OutputProcessor(tokenizer, frozenset(self.eos_token_ids))
        per_block = kv_bytes_per_block(cfg, config.block_size, self.dtype, config.kv_cache_dtype)
        from rooflm.worker.swap_space import setup_swap

        setup_swap(self, per_block)
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        from rooflm.spec_decode.config import SpeculativeConfig
        from rooflm.spec_decode.proposer import SpeculativeProposer

        self.spec_config = SpeculativeConfig.parse(config.speculative_config)
        self.proposer = None
        if self.spec_config is not None:
            # Drafts are proposed from the tokens of the step just read back, so steps cannot overlap.
            self.async_scheduling = False
            self.proposer = SpeculativeProposer(self.spec_config, self.roofline, self.max_model_len)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB of %s), at most %d tokens; max_model_len=%d; "
                    "%s on %s%s", num_blocks, config.block_size, num_blocks * per_block / 2**20,
                    _kv_dtype_text(config.kv_cache_dtype, self.kv_dtype), num_blocks * config.block_size,
                    self.max_model_len, str(self.dtype).removeprefix("torch."), self.device,
                    "; asynchronous scheduling" if self.async_scheduling else "")
        if self.device.type == "cuda" and not config.enforce_eager:
            self.runner.capture_graphs(config.max_num_seqs)
        self._ids = itertools.count()
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle, float]] = deque()
        self._last_done = 0.0  # when the host last saw a step complete
        self.stats = EngineStats(num_total_blocks=num_blocks)
        self.admission = None  # TTFTPredictor under ttft_slo_ms (rooflm.engine.admission)
        if config.ttft_slo_ms is not None:
            from rooflm.engine.admission import TTFTPredictor

            roofline = self.roofline
            self.admission = TTFTPredictor(lambda q, c, r: roofline.predict(q, c, r) / (roofline.fraction() or 1.0),
                                           config.max_num_batched_tokens, config.max_num_seqs)

    # -- set-up ---------------------------------------------------------------------------------------------------------
    def _num_blocks(self, cfg: ModelConfig) -> int:
        c = self.config
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override
        per_block = kv_bytes_per_block(cfg, c.block_size, self.dtype, c.kv_cache_dtype)
        budget = c.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                # What the weights and a profiled forward pass at the batch limits leave of the allowed share
                # (nano-vllm's and vLLM's rule: size the pool from measured peaks, not a guess).
                peak = profile_activation_bytes(self.model, cfg, c.max_num_batched_tokens, c.max_num_seqs,
                                                c.block_size, self.device, self.dtype, c.kv_cache_dtype)
                free, total = torch.cuda.mem_get_info(self.device)
                budget = int(total * c.gpu_memory_utilization) - (total - free) - peak - _CUDA_GRAPH_RESERVE
                logger.info("KV sizing: %.2f GiB in use, activation peak %.2f GiB, %.2f GiB left for the KV pool",
                            (total - free) / 2**30, peak / 2**30, budget / 2**30)
            else:
                budget = _CPU_KV_DEFAULT
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block: one block of {c.block_size} tokens "
                             f"takes {per_block} bytes for this model (raise gpu_memory_utilization or "
                             "lower max_num_batched_tokens)")
        return int(num_blocks)

    def _max_model_len(self, cfg: ModelConfig, num_blocks: int) -> int:
        c = self.config
        # with KV compression a request holds at most its budget: its length is not bounded by the pool
        capacity = cfg.max_position_embeddings if self.kv_compression is not None else num_blocks * c.block_size
        if c.max_model_len is not None:
            if c.max_model_len > cfg.max_position_embeddings:
                raise ValueError(f"max_model_len={c.max_model_len} exceeds the model's max_position_embeddings="
                                 f"{cfg.max_position_embeddings}")
            if c.max_model_len > capacity:
                raise ValueError(f"max_model_len={c.max_model_len} does not fit the KV pool of {capacity} tokens "
                                 f"({num_blocks} blocks): raise kv_cache_memory or lower max_model_len")
            return c.max_model_len
        default = 8192 if self.device.type == "cuda" else 2048
        return min(cfg.max_position_embeddings, default, capacity)

    def _eos_ids(self, cfg: ModelConfig) -> list[int]:
        ids = set(cfg.eos_token_id)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    # -- requests -------------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int | None = None, user: str | None = None) -> str:
        """Queue a request. Raises ValueError, naming the field and value, for input it cannot serve.

        ``priority`` (lower first) and ``user`` (the client) override ``params.priority`` / ``params.user``; they
        matter under the "priority" and "fair" scheduling policies.

        ``n > 1`` fans out here into n child requests (each its own sample, seeded by its index); the scheduler and
        the runner never see n, and the children share the prompt's KV blocks through the prefix cache."""
        from rooflm.layers.sampler import make_generator

        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r} is invalid: expected a SamplingParams")
        if priority is not None or user is not None:
            params = params.clone(priority=params.priority if priority is None else priority,
                                  user=params.user if user is None else user)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.parents:
            raise ValueError(f"request_id={request_id!r} is already in use")
        prompt_text, token_ids = self._tokenize(prompt)
        n = len(token_ids)
        if n > self.max_model_len:
            pool = self.kv.num_blocks * self.kv.block_size
            why = f" (limited by the KV pool of {pool} tokens)" if self.max_model_len == pool else ""
            raise ValueError(f"prompt has {n} tokens, more than max_model_len={self.max_model_len}{why}")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is out of the vocabulary [0, {vocab})")
        if self.admission is not None:  # SLORejectedError: nothing was queued
            self.admission.check(request_id, n, self.scheduler, self.config.ttft_slo_ms / 1e3)
        arrival = arrival_time or time.monotonic()
        child_params = [params.clone(n=1) if i == 0 else params.clone(n=1, prompt_logprobs=None)
                        for i in range(params.n)]
        metrics = [RequestMetrics(arrival_time=arrival) for _ in range(params.n)]
        child_ids = self.output_processor.add_request(request_id, prompt_text, token_ids, params, child_params,
                                                      metrics)
        for i, (cid, cp, m) in enumerate(zip(child_ids, child_params, metrics)):
            gen = make_generator(params.seed, i, self.device) if params.seed is not None else None
            self.scheduler.add_request(Request(cid, token_ids, cp, m, gen))
        return request_id

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text but this model has no tokenizer (dummy weights): pass token ids")
            ids = list(self.tokenizer(prompt)["input_ids"])
            text: str | None = prompt
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids, text = list(prompt), None
        else:
            raise ValueError(f"prompt={prompt!r:.80} is invalid: expected a string or a list of token ids")
        if not ids:
            raise ValueError("prompt is empty: it must have at least one token")
        return text, ids

    def abort_request(self, request_id: str) -> None:
        request_id = str(request_id)
        self.scheduler.finish_requests(self.output_processor.child_ids(request_id), FINISH_ABORT)
        self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    # -- one step -------------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step. Synchronous: schedule, execute, wait, update. Asynchronous: schedule and launch
        this step, then finish the previous one (its outputs are what this call returns)."""
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running, self.stats)
        out = self.scheduler.schedule()
        if not out.is_empty:
            launched = time.perf_counter()
            self._in_flight.append((out, self.runner.execute(out), launched))
            self.stats.num_steps += 1
        depth = 2 if self.async_scheduling else 1
        if not self._in_flight or (len(self._in_flight) < depth and not out.is_empty):
            return []
        done_out, handle, launched = self._in_flight.popleft()
        result = handle.get()
        done = time.perf_counter()
        # A step's time: from its launch (input preparation included) or from the previous step's completion,
        # whichever is later, to its results being on the host. Under asynchronous scheduling the next step's
        # preparation overlaps this one and is not counted twice.
        self.roofline.observe(list(done_out.num_scheduled_tokens.values()),
                              list(done_out.num_computed_tokens_after.values()),
                              len(done_out.sampling_req_ids), done - max(launched, self._last_done))
        self._last_done = done
        core_outputs = self.scheduler.update_from_output(done_out, result)
        outputs, to_stop = self.output_processor.process(core_outputs, time.monotonic())
        for child_id, stop_str in to_stop:
            self.scheduler.finish_requests([child_id], FINISH_STOP, stop_str)
        self.stats.generation_tokens_total += sum(len(o.new_token_ids) for o in core_outputs)
        return outputs

    # -- stats ----------------------------------------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        s = self.stats
        s.num_running = self.scheduler.num_running
        s.num_waiting = self.scheduler.num_waiting
        s.num_free_blocks = self.kv.num_free_blocks
        s.kv_usage = self.kv.usage
        s.peak_blocks_used = self.scheduler.peak_blocks_used
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_queries = self.kv.prefix_queries
        s.prefix_hits = self.kv.prefix_hits
        s.prompt_tokens_total = self.scheduler.num_prompt_tokens_computed
        s.spec_draft_tokens = self.scheduler.num_draft_tokens
        s.spec_accepted_tokens = self.scheduler.num_accepted_tokens
        s.spec_verifications = self.scheduler.num_verifications
        self.roofline.fill_stats(s)
        return s
