"""LLMEngine: requests in, one scheduler step + one forward pass per ``step()``, outputs out.

Stop conditions are checked here after each step (EOS, stop token ids, stop strings, max_tokens, max_model_len);
finished sequences release their KV blocks before the next schedule.
"""
from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from rooflm.config import EngineConfig, ModelConfig, SchedulerConfig
from rooflm.engine.scheduler import Scheduler
from rooflm.engine.sequence import Request, Sequence
from rooflm.engine.stats import EngineStats
from rooflm.engine.stop_checker import check_stop, is_stop_token
from rooflm.kv_cache import KVCacheManager
from rooflm.logger import get_logger
from rooflm.outputs import RequestMetrics, RequestOutput
from rooflm.sampling_params import SamplingParams
from rooflm.worker.model_runner import ModelRunner, kv_bytes_per_block

logger = get_logger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_CPU_KV_DEFAULT = 512 * 2**20  # bytes of KV pool on the CPU unless told otherwise
_CUDA_MEMORY_FRACTION = 0.90  # of the memory free after loading weights


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


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, model: torch.nn.Module | None = None,
                 model_config: ModelConfig | None = None, tokenizer: Any = None, **kwargs: Any) -> None:
        """Load ``config.model`` (or serve an already loaded ``model`` with its ``model_config`` and ``tokenizer``,
        e.g. one shared by several engines)."""
        from rooflm.attention.backend import get_attention_backend
        from rooflm.loader import load_model
        from rooflm.tokenizer import load_tokenizer

        self.config = config = config or EngineConfig(**kwargs)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        if model is None:
            backend = get_attention_backend(config.attention_backend, self.device)
            model, model_config = load_model(
                config.model, load_format=config.load_format, dtype=self.dtype, device=self.device,
                attn_backend=backend, seed=config.seed, show_progress=config.show_progress)
            if config.load_format != "dummy" or config.tokenizer:
                tokenizer = load_tokenizer(config.tokenizer or config.model)
        elif model_config is None:
            raise ValueError("model_config is required with a preloaded model")
        self.model, self.model_config = model.eval(), model_config
        self.tokenizer = tokenizer
        self.model_name = config.model or "SmolLM2-135M-Instruct"
        cfg = self.model_config

        num_blocks = self._num_blocks(cfg)
        self.max_model_len = self._max_model_len(cfg, num_blocks)
        self.eos_token_ids = self._eos_ids(cfg)
        self.scheduler_config = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                                                self.max_model_len)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.eos_token_ids)
        self.runner = ModelRunner(self.model, cfg, num_blocks, config.block_size, self.device, self.dtype)
        per_block = kv_bytes_per_block(cfg, config.block_size, self.dtype)
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB), at most %d tokens; max_model_len=%d; %s on %s",
                    num_blocks, config.block_size, num_blocks * per_block / 2**20, num_blocks * config.block_size,
                    self.max_model_len, str(self.dtype).removeprefix("torch."), self.device)
        if self.device.type == "cuda" and not config.enforce_eager:
            self._maybe_capture_graphs()
        self._ids = itertools.count()
        self.stats = EngineStats(num_total_blocks=num_blocks)

    # -- set-up ---------------------------------------------------------------------------------------------------------
    def _num_blocks(self, cfg: ModelConfig) -> int:
        c = self.config
        if c.num_gpu_blocks_override is not None:
            return c.num_gpu_blocks_override
        per_block = kv_bytes_per_block(cfg, c.block_size, self.dtype)
        budget = c.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * _CUDA_MEMORY_FRACTION) - 2**30  # room for activations and graphs
            else:
                budget = _CPU_KV_DEFAULT
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block: one block of {c.block_size} tokens "
                             f"takes {per_block} bytes for this model")
        return int(num_blocks)

    def _max_model_len(self, cfg: ModelConfig, num_blocks: int) -> int:
        c = self.config
        capacity = num_blocks * c.block_size
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

    def _maybe_capture_graphs(self) -> None:
        try:
            from rooflm.worker.cuda_graphs import capture_decode_graphs
        except ImportError:
            return
        self.runner.graph_runner = capture_decode_graphs(self.runner, self.config.max_num_seqs)

    # -- requests -------------------------------------------------------------------------------------------------------
    def add_request(self, request_id: str | None, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """Queue a request. Raises ValueError, naming the field and value, for input it cannot serve."""
        from rooflm.engine.detokenizer import IncrementalDetokenizer
        from rooflm.layers.sampler import make_generator

        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params={params!r} is invalid: expected a SamplingParams")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
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
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        request = Request(request_id, prompt_text, token_ids, params, metrics)
        for seq in request.seqs:
            if params.seed is not None:
                seq.generator = make_generator(params.seed, seq.index, self.device)
            if self.tokenizer is not None:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        self.scheduler.add_request(request)
        self.stats.prompt_tokens_total += n
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
        self.scheduler.abort_request(str(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- one step -------------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        results = self.runner.execute(out)
        self.stats.num_steps += 1
        for sch in out.scheduled:
            request = self.scheduler.requests.get(sch.request_id)
            if request is not None and request.prompt_logprobs is not None:
                for pos, d in results[sch.seq_id].prompt_logprobs:
                    request.prompt_logprobs[pos] = d
        got_token = self.scheduler.update(out, {sid: r.sampled for sid, r in results.items() if r.sampled})
        now = time.monotonic()
        progressed: dict[str, Request] = {}
        for seq, sched_id, row in got_token:
            res = results[sched_id]
            if seq.logprobs is not None and res.logprobs:
                seq.logprobs.append(res.logprobs[row])
                seq.cumulative_logprob += res.sampled_logprobs[row]
            self._check_stop(seq)
            m = seq.request.metrics
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            progressed[seq.request.request_id] = seq.request
        self.stats.generation_tokens_total += len(got_token)
        outputs = []
        for request in progressed.values():
            if request.finished:
                request.metrics.finished_time = now
            outputs.append(request.to_output())
        return outputs

    def _check_stop(self, seq: Sequence) -> None:
        p, token, n_out = seq.params, seq.all_token_ids[-1], seq.num_output_tokens
        stop_str = None
        if seq.detokenizer is not None:
            ends_on_token = is_stop_token(token, n_out, p, self.eos_token_ids)
            stop_str = seq.detokenizer.append(token, is_stop_token=ends_on_token)
            seq.text += seq.detokenizer.get_delta()
        reason = check_stop(token, n_out, p, self.eos_token_ids, stop_str, seq.num_tokens, self.max_model_len)
        if reason is not None:
            self._finish(seq, *reason)

    def _finish(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        if seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()
        self.scheduler.finish(seq, reason, stop_reason)

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
        return s
