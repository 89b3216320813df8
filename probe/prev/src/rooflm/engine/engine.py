"""LLMEngine: requests in, one scheduler step + one forward pass per ``step()``, outputs out.

The step contract (see docs/architecture.md): ``Scheduler.schedule()`` -> ``SchedulerOutput`` (diffs) ->
``ModelRunner.execute()`` -> ``StepHandle`` -> ``Scheduler.update_from_output()`` -> ``EngineCoreOutput``s ->
``OutputProcessor.process()`` -> ``RequestOutput``s.

Asynchronous scheduling (``async_scheduling``): ``step()`` schedules and launches step N+1 *before* it waits for
step N, so the host's scheduling and input preparation overlap the device's forward pass. The token sampled in
step N feeds step N+1 on the device; the host reads it one step later for outputs and stop checks, and whatever a
request computed after its stop condition is dropped, so outputs equal the synchronous mode's. With speculative
decoding only the steps in which speculation is switched off are pipelined: drafts continue from tokens on the host,
so before a step that drafts the step in flight is finished, and a drafting step completes before the next is
scheduled (``SpeculativeProposer.will_draft``).
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any

import torch

from rooflm.attention.kv_quant import kv_storage_dtype
from rooflm.config import EngineConfig, ModelConfig
from rooflm.distributed.executor import tp_cuda_graphs
from rooflm.distributed.partition import roofline_share, shard_model_config
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


def kv_pool_blocks(c: EngineConfig, model: torch.nn.Module, cfg: ModelConfig, device: torch.device,
                   dtype: torch.dtype, extra_block_bytes: int = 0) -> int:
    """KV blocks of this process's pool (``cfg``: the model config with this rank's KV heads). On CUDA without a
    set ``kv_cache_memory``, what the weights and a profiled forward pass at the batch limits leave of the allowed
    share (nano-vllm's and vLLM's rule: size the pool from measured peaks, not a guess); under tensor parallelism
    ``kv_cache_memory`` is the budget of each rank. ``extra_block_bytes``: what else a block costs (a draft model's
    pool has as many blocks as the target's: they share the block tables)."""
    if c.num_gpu_blocks_override is not None:
        return c.num_gpu_blocks_override
    per_block = kv_bytes_per_block(cfg, c.block_size, dtype, c.kv_cache_dtype) + extra_block_bytes
    budget = c.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            peak = profile_activation_bytes(model, cfg, c.max_num_batched_tokens, c.max_num_seqs,
                                            c.block_size, device, dtype, c.kv_cache_dtype)
            free, total = torch.cuda.mem_get_info(device)
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


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model: torch.nn.Module | None = None,
                 model_config: ModelConfig | None = None, tokenizer: Any = None, **kwargs: Any) -> None:
        """Load ``config.model`` (or serve an already loaded ``model`` with its ``model_config`` and ``tokenizer``,
        e.g. one shared by several engines)."""
        from rooflm.loader import load_model
        from rooflm.tokenizer import load_tokenizer

        self.config = config = config or EngineConfig(**kwargs)
        if config.data_parallel_size != 1:
            raise ValueError(f"data_parallel_size={config.data_parallel_size}: one LLMEngine is one replica; replicas "
                             "run behind the server (rooflm serve --data-parallel-size N, "
                             "rooflm.engine.data_parallel.DataParallelEngine)")
        self.device = resolve_device(config.device)
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1 and not hasattr(self, "parallel"):
            from rooflm.distributed.engine_setup import init_parallel_engine

            # starts the workers, joins their process group, then runs this __init__ again inside it
            return init_parallel_engine(self, config, model, model_config, tokenizer)
        self.parallel = getattr(self, "parallel", None)  # rooflm.distributed.executor.MultiprocExecutor
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        if model is None:
            model, model_config = load_model(
                config.model, load_format=config.load_format, dtype=self.dtype, device=self.device,
                attn_backend=config.attention_backend, ops=config.ops, seed=config.seed,
                show_progress=config.show_progress, quantization=config.quantization,
                cpu_offload_gb=config.cpu_offload_gb)
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
        # a quantized model's bound is for the bytes its packed weights (and its cache) really take; under tensor
        # parallelism it is one GPU's share (every rank runs the same step)
        live_cfg, live_tp = roofline_share(cfg, config.tensor_parallel_size, config.enable_expert_parallel)
        self.roofline = LiveRoofline.for_engine(live_cfg, self.dtype, self.device, kv_dtype=self.kv_dtype,
                                                weight_format=weight_format(self.model), tp=live_tp,
                                                expert_parallel=config.enable_expert_parallel and live_tp > 1)
        from rooflm.spec_decode.config import SpeculativeConfig

        self.spec_config = SpeculativeConfig.parse(config.speculative_config)
        self._draft, self._draft_block_bytes = self._load_draft(cfg)
        kv_cfg = shard_model_config(cfg, config.tensor_parallel_size, 0, config.pipeline_parallel_size)  # rank 0's KV
        num_blocks = self._num_blocks(kv_cfg)
        if self.parallel is not None:
            num_blocks = self.parallel.agree_num_blocks(num_blocks)
        from rooflm.kv_cache.compression import KVCompressionConfig

        self.kv_compression = KVCompressionConfig.parse(config.kv_compression)
        if self.kv_compression is not None:
            self.kv_compression.check(config.block_size)
        self.max_model_len = self._max_model_len(cfg, num_blocks)
        self.eos_token_ids = self._eos_ids(cfg)
        if self.parallel is not None:
            self.parallel.start_runners(self.max_model_len, self.eos_token_ids)
        self.scheduler_config = config.scheduler_config(self.max_model_len, self.roofline.prefill_chunk_tokens())
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.eos_token_ids)
        self.scheduler.compression = self.kv_compression
        self.runner = ModelRunner(self.model, kv_cfg, num_blocks, config.block_size, self.device, self.dtype,
                                  config.max_num_seqs, self.max_model_len, self.eos_token_ids,
                                  kv_cache_dtype=config.kv_cache_dtype)
        self.output_processor = OutputProcessor(tokenizer, frozenset(self.eos_token_ids))
        per_block = kv_bytes_per_block(kv_cfg, config.block_size, self.dtype, config.kv_cache_dtype)
        from rooflm.worker.swap_space import setup_swap

        setup_swap(self, per_block)
        from rooflm.worker.kv_offload import setup_kv_offload

        setup_kv_offload(self, per_block)
        self.async_scheduling = (self.device.type == "cuda" if config.async_scheduling is None
                                 else config.async_scheduling)
        if self.kv_compression is not None and self.kv_compression.method == "h2o":
            self.async_scheduling = False  # H2O drops by the scores of the step just read back
        from rooflm.spec_decode.proposer import SpeculativeProposer

        self.proposer = None
        if self.spec_config is not None:
            # Drafts are proposed from the tokens of the step just read back: only steps without drafts overlap.
            self.proposer = SpeculativeProposer(self.spec_config, self.roofline, self.max_model_len)
            if self.spec_config.method != "ngram":
                self._make_drafter(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB of %s), at most %d tokens; max_model_len=%d; "
                    "%s on %s%s", num_blocks, config.block_size, num_blocks * per_block / 2**20,
                    _kv_dtype_text(config.kv_cache_dtype, self.kv_dtype), num_blocks * config.block_size,
                    self.max_model_len, str(self.dtype).removeprefix("torch."), self.device,
                    self._scheduling_text())
        graphs_ok = self.parallel is None or tp_cuda_graphs(config)  # see tp_cuda_graphs; never under PP
        # offloaded weights are copied in by Python hooks around each layer, which a CUDA graph would not replay
        offloading = getattr(self.model, "weight_offloader", None) is not None
        if self.device.type == "cuda" and not config.enforce_eager and graphs_ok and not offloading:
            self.runner.capture_graphs(config.max_num_seqs, self._verify_graph_tokens())
        self._ids = itertools.count()
        self._in_flight: deque[tuple[SchedulerOutput, StepHandle, float]] = deque()
        self._last_done = 0.0  # when the host last saw a step complete
        self.stats = EngineStats(num_total_blocks=num_blocks)
        self.structured = None  # StructuredOutputManager, made when the first request with a grammar comes
        self.admission = None  # TTFTPredictor under ttft_slo_ms (rooflm.engine.admission)
        if config.ttft_slo_ms is not None:
            from rooflm.engine.admission import ADMISSION_QUANTILE, TTFTPredictor

            roofline = self.roofline
            self.admission = TTFTPredictor(
                lambda q, c, r: roofline.predict(q, c, r) / (roofline.fraction_quantile(ADMISSION_QUANTILE) or 1.0),
                config.max_num_batched_tokens, config.max_num_seqs)

    def _verify_graph_tokens(self) -> int:
        """Drafts per request that verify steps are captured for: a chain of k drafts; 0 without speculation or with
        token trees (a tree's mask makes each step's shape its own)."""
        sc = self.spec_config
        return sc.num_speculative_tokens if sc is not None and sc.tree_shape() is None else 0

    def _scheduling_text(self) -> str:
        if not self.async_scheduling:
            return "; synchronous scheduling" if self.proposer is not None else ""
        if self.proposer is not None:
            return "; asynchronous scheduling while speculation is switched off (drafting steps run synchronously)"
        return "; asynchronous scheduling"

    def _structured_manager(self):
        if self.structured is None:
            from rooflm.structured.manager import StructuredOutputManager

            self.structured = StructuredOutputManager(self.tokenizer, self.model_config.vocab_size,
                                                      self.eos_token_ids, pin_memory=self.device.type == "cuda")
        return self.structured

    # -- set-up ---------------------------------------------------------------------------------------------------------
    def _load_draft(self, cfg: ModelConfig) -> tuple[Any, int]:
        """The draft model of ``speculative_config`` method "draft_model" and its KV bytes per block (else None, 0)."""
        if self.spec_config is None or self.spec_config.method != "draft_model":
            return None, 0
        from rooflm.spec_decode.drafter import draft_bytes_per_block, load_draft_model

        c = self.config
        draft = load_draft_model(self.spec_config, cfg, self.device, self.dtype, c.quantization, c.ops,
                                 c.attention_backend, c.seed)
        return draft, draft_bytes_per_block(draft[1], c.block_size, self.dtype, c.kv_cache_dtype)

    def _make_drafter(self, num_blocks: int) -> None:
        from rooflm.spec_decode.drafter import Drafter

        if self.spec_config.method == "medusa":  # heads on the target's hidden states; they write no KV
            from rooflm.spec_decode.medusa import MedusaDrafter

            self.runner.drafter = MedusaDrafter(self.spec_config, self.model, self.model_config, self.device,
                                                self.dtype, self.max_model_len, self.config.block_size)
            self.proposer.draft_cost = self.runner.drafter.cost_fraction
            if self.spec_config.tree is not None:  # the proposer hands over (and cuts) a tree's nodes
                import dataclasses

                self.proposer.config = dataclasses.replace(self.spec_config,
                                                           num_speculative_tokens=self.runner.drafter.num_nodes)
            return
        drafter = Drafter(self.spec_config, self.model, self.model_config, self.runner.kv_caches, num_blocks,
                          self.config.block_size, self.device, self.dtype, self.max_model_len,
                          self.config.kv_cache_dtype, self._draft)
        self.runner.drafter = drafter
        self.scheduler.num_lookahead_tokens = self.spec_config.num_speculative_tokens
        self.proposer.draft_cost = drafter.cost_fraction

    def _num_blocks(self, cfg: ModelConfig) -> int:
        return kv_pool_blocks(self.config, self.model, cfg, self.device, self.dtype, self._draft_block_bytes)

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
        spec = params.structured_outputs
        if spec is not None:
            self._structured_manager().compile(spec)  # a schema / regex / grammar the backend refuses: ValueError
        if params.kv_compression is not None and params.kv_compression.method == "h2o" and (
                self.async_scheduling or self.config.kv_cache_dtype != "auto"):
            raise ValueError(f"kv_compression={params.kv_compression}: method 'h2o' needs async_scheduling=False and "
                             "kv_cache_dtype='auto' (it drops blocks by the unquantized attention scores of the step "
                             "just read back)")
        if params.kv_compression is not None and self.runner.drafter is not None:
            raise ValueError(f"kv_compression={params.kv_compression} is not supported with speculative_config method "
                             f"{self.spec_config.method!r} (the draft's cache follows uncompressed positions)")
        arrival = arrival_time or time.monotonic()
        if self.admission is not None:  # SLORejectedError: nothing was queued
            waited = time.monotonic() - arrival  # since the server received it (its own clock: time.monotonic)
            predicted = self.admission.check(request_id, n, self.scheduler, self.config.ttft_slo_ms / 1e3,
                                             len(self._in_flight), waited)
            logger.debug("admitted %s: predicted TTFT %.0f ms (%.0f ms before the engine)", request_id,
                         predicted * 1e3, waited * 1e3)
        child_params = [params.clone(n=1) if i == 0 else params.clone(n=1, prompt_logprobs=None)
                        for i in range(params.n)]
        metrics = [RequestMetrics(arrival_time=arrival) for _ in range(params.n)]
        child_ids = self.output_processor.add_request(request_id, prompt_text, token_ids, params, child_params,
                                                      metrics)
        for i, (cid, cp, m) in enumerate(zip(child_ids, child_params, metrics)):
            gen = make_generator(params.seed, i, self.device) if params.seed is not None else None
            if spec is not None:
                self.structured.add_request(cid, spec)  # each child its own matcher
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
        children = self.output_processor.child_ids(request_id)
        self.scheduler.finish_requests(children, FINISH_ABORT)
        if self.structured is not None:
            self.structured.remove(children)
        self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._in_flight)

    # -- one step -------------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step. Synchronous: schedule, execute, wait, update. Asynchronous: schedule and launch
        this step, then finish the previous one (its outputs are what this call returns)."""
        outputs = self._propose() if self.proposer is not None else []
        out = self.scheduler.schedule()
        if self.structured is not None and not out.is_empty:
            self.structured.attach_bitmask(out)
        if self.runner.drafter is not None:
            self.runner.drafter.enabled = self.proposer.drafting
        if not out.is_empty:
            launched = time.perf_counter()
            handle = self.runner.execute(out) if self.parallel is None else self.parallel.execute(self.runner, out)
            self._in_flight.append((out, handle, launched))
            self.stats.num_steps += 1
        # a step that drafts or verifies completes before the next is scheduled (its drafts continue from its tokens)
        depth = 2 if self.async_scheduling and (self.proposer is None or not self.proposer.drafting) else 1
        if not self._in_flight or (len(self._in_flight) < depth and not out.is_empty):
            return outputs
        done = self._finish_step()
        if not outputs:
            return done
        latest = {o.request_id: o for o in outputs + done}  # outputs are cumulative: one per request, the newest
        return list(latest.values())

    def _propose(self) -> list[RequestOutput]:
        """Drafts for the coming step. Under asynchronous scheduling a step that will not draft is pipelined; before
        one that will, the step in flight is finished (its outputs are returned), so that drafts continue from tokens
        on the host exactly as in the synchronous mode."""
        running = self.scheduler.running
        if self.async_scheduling and not self.proposer.will_draft(running, self.stats):
            self.proposer.skip(running, self.stats)
            return []
        outputs = []
        while self._in_flight:
            outputs += self._finish_step()
        self.proposer.propose(self.scheduler.running, self.stats)
        return outputs

    def _finish_step(self) -> list[RequestOutput]:
        """Wait for the oldest step in flight and apply its results: tokens, stop checks, drafts, outputs."""
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
        if self.proposer is not None:
            self.proposer.receive(result.draft_token_ids)
        core_outputs = self.scheduler.update_from_output(done_out, result)
        if self.structured is not None:
            self.structured.accept(core_outputs)
        outputs, to_stop = self.output_processor.process(core_outputs, time.monotonic())
        for child_id, stop_str in to_stop:
            self.scheduler.finish_requests([child_id], FINISH_STOP, stop_str)
        if self.structured is not None and to_stop:
            self.structured.remove(c for c, _ in to_stop)
        self.stats.generation_tokens_total += sum(len(o.new_token_ids) for o in core_outputs)
        return outputs

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do on one rank). Idempotent; also run at interpreter exit."""
        if self.parallel is not None:
            self.parallel.shutdown()

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
        if self.scheduler.host_tier is not None:
            s.fill_host_tier(self.scheduler.host_tier)
        self.roofline.fill_stats(s)
        return s
