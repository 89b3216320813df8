"""Typed configuration. Every dataclass validates itself in ``__post_init__``: a bad value raises ``ValueError``
naming the field, the value seen and what is accepted."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from importlib import resources
from typing import Any

SUPPORTED_DTYPES = ("float32", "float16", "bfloat16")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority", "mlfq", "fair")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")  # vLLM's names; fp8 is float8_e4m3fn
PREEMPTION_MODES = ("recompute", "swap", "auto")  # vLLM's names (rooflm.kv_cache.swap)


def _bad(cls: str, name: str, value: object, accepted: str) -> ValueError:
    return ValueError(f"{cls}.{name}={value!r} is invalid: expected {accepted}")


def parse_json_config(cls: type, value: Any, name: str) -> Any:
    """An instance of the dataclass ``cls`` from itself, a dict of its fields or that dict's JSON text (a CLI flag);
    None stays None. ValueError naming ``name`` for invalid JSON, a non-object or an unknown field."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name}={value!r} is not valid JSON: {e.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name}={value!r} is invalid: expected a JSON object")
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {unknown}: accepted are {sorted(known)}")
    return cls(**value)


# ---------------------------------------------------------------------------------------------------------------------
# Model architecture
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class ModelConfig:
    """Architecture hyper-parameters, in Hugging Face config.json names. Built from a HF config dict, a named config
    shipped in ``rooflm/configs`` or GGUF metadata (see ``load_model_config``)."""

    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projection bias (Qwen2)
    sliding_window: int | None = None  # None: full attention
    hidden_act: str = "silu"
    num_local_experts: int = 0  # MoE (Mixtral); 0 means dense
    num_experts_per_tok: int = 0
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    name: str | None = None  # a named config's name, or the path it came from
    source: str | None = None  # where the numbers come from
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)  # the raw dict (for transformers)

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise _bad("ModelConfig", f, v, "a positive integer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise _bad("ModelConfig", "num_key_value_heads", self.num_key_value_heads,
                       f"a divisor of num_attention_heads={self.num_attention_heads}")

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str | None = None) -> "ModelConfig":
        archs = d.get("architectures") or []
        model_type = d.get("model_type", "")
        arch = archs[0] if archs else _ARCH_BY_TYPE.get(model_type, model_type or "unknown")
        heads = d["num_attention_heads"]
        eos = d.get("eos_token_id")
        eos_list = [] if eos is None else (list(eos) if isinstance(eos, (list, tuple)) else [eos])
        sliding = d.get("sliding_window")
        if d.get("use_sliding_window") is False:  # Qwen2 ships a window it does not use
            sliding = None
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rope_params = d.get("rope_parameters")  # transformers >= 5 folds theta and scaling in here
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = dict(rope_params)
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            sliding_window=sliding,
            hidden_act=d.get("hidden_act", "silu"),
            num_local_experts=d.get("num_local_experts", 0) or 0,
            num_experts_per_tok=d.get("num_experts_per_tok", 0) or 0,
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos_list,
            torch_dtype=d.get("torch_dtype") or d.get("dtype"),
            name=name or d.get("_name"),
            source=d.get("_source"),
            hf_config={k: v for k, v in d.items() if not k.startswith("_")},
        )


_ARCH_BY_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def named_configs() -> list[str]:
    """Names of the configs shipped with rooflm (hyper-parameters only), e.g. ``llama-2-7b``."""
    files = resources.files("rooflm") / "configs"
    return sorted(p.name[: -len(".json")] for p in files.iterdir() if p.name.endswith(".json"))


def load_model_config(model: str) -> ModelConfig:
    """Resolve ``model`` to its architecture: a named config (``llama-2-7b``), a checkpoint folder with config.json,
    a config.json file, or a GGUF file."""
    if model in named_configs():
        text = (resources.files("rooflm") / "configs" / f"{model}.json").read_text()
        return ModelConfig.from_hf_dict(json.loads(text), name=model)
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"model={model!r}: the folder has no config.json")
        with open(path) as f:
            return ModelConfig.from_hf_dict(json.load(f), name=model)
    if os.path.isfile(model) and model.endswith(".json"):
        with open(model) as f:
            return ModelConfig.from_hf_dict(json.load(f), name=model)
    if os.path.isfile(model) and model.endswith(".gguf"):
        from rooflm.loader.gguf import read_gguf_config

        return read_gguf_config(model)
    raise ValueError(
        f"model={model!r} is neither a named config ({', '.join(named_configs())}), a folder with config.json, "
        "a config.json file nor a .gguf file"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Engine
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory: int | None = None  # bytes for the KV pool; None: a default from the device
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # tests: an exact pool size
    # "auto": the model's dtype; "int8" / "fp8" (float8_e4m3fn): one byte per value plus a float32 scale per token
    # and KV head, about half the bytes of a 16-bit cache (rooflm.attention.kv_quant).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise _bad("CacheConfig", "block_size", self.block_size, "a positive integer")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _bad("CacheConfig", "kv_cache_dtype", self.kv_cache_dtype, f"one of {KV_CACHE_DTYPES}")
        if self.kv_cache_memory is not None and (not isinstance(self.kv_cache_memory, int) or self.kv_cache_memory < 1):
            raise _bad("CacheConfig", "kv_cache_memory", self.kv_cache_memory, "a positive number of bytes")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise _bad("CacheConfig", "num_gpu_blocks_override", self.num_gpu_blocks_override, "a positive integer")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    max_num_seqs: int = 256  # running requests (each of the n samples counts) at most
    max_model_len: int = 2048  # prompt + generated tokens of one sequence at most
    # Who is admitted and who is preempted: "fcfs" | "priority" | "mlfq" | "fair" (see rooflm.engine.policy).
    scheduling_policy: str = "fcfs"
    # mlfq (FastServe, Wu et al. 2023): levels, the top level's quantum of generated tokens (doubling per level),
    # the longest prompt that joins the top level (one level lower per doubling), and the steps a waiting request
    # waits before it is promoted back to the top level.
    mlfq_num_levels: int = 4
    mlfq_quantum: int = 16
    mlfq_skip_join_tokens: int = 256
    mlfq_starvation_steps: int = 512
    # fair (Virtual Token Counter, Sheng et al. 2024): service per prompt token and per generated token.
    fair_input_weight: float = 1.0
    fair_output_weight: float = 2.0
    # priority: the most prompt tokens the requests of classes worse than the best seen compute per step together
    # (a step in flight is what a better-class arrival waits for first), and none while a better class computes its
    # prompt (rooflm.engine.policy); None or 0 (the command line's way to say it): neither rule.
    priority_prefill_chunk: int | None = 16

    def __post_init__(self) -> None:
        for f in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "mlfq_num_levels", "mlfq_quantum",
                  "mlfq_skip_join_tokens", "mlfq_starvation_steps"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _bad("SchedulerConfig", f, v, "a positive integer")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise _bad("SchedulerConfig", "scheduling_policy", self.scheduling_policy,
                       f"one of {SCHEDULING_POLICIES}")
        for f in ("fair_input_weight", "fair_output_weight"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise _bad("SchedulerConfig", f, v, "a number > 0")
        v = self.priority_prefill_chunk
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise _bad("SchedulerConfig", "priority_prefill_chunk", v, "None, 0 (off) or a positive integer")
        if v == 0:
            self.priority_prefill_chunk = None


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct GGUF)
    load_format: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    device: str = "auto"  # auto: cuda if available
    tokenizer: str | None = None
    max_model_len: int | None = None  # None: min(model's max_position_embeddings, 2048 on CPU / 8192 on CUDA)
    kv_cache_memory: int | None = None
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) | "int8" | "fp8": see CacheConfig
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    seed: int = 0  # dummy weights and requests without their own seed
    enforce_eager: bool = False  # no CUDA graphs
    attention_backend: str = "auto"  # "torch" (reference) | "triton" | "cpu" | "auto" (follows ``ops``)
    # Which implementation each op (linear, norm, activation, rotary + KV write) picks, once, when the model is built:
    # "auto" (Triton kernels on CUDA when importable and ROOFLM_KERNELS != "0"), "native" (plain torch), "triton".
    ops: str = "auto"
    show_progress: bool = True
    # Schedule and prepare step N+1 while step N runs on the device. None: on for CUDA, off on the CPU (where the
    # forward pass runs on the calling thread, so there is nothing to overlap).
    async_scheduling: bool | None = None
    # CUDA: the fraction of the device's memory this engine may use; the KV pool gets what the weights and the peak
    # activations of a profiled forward pass at the configured batch limits leave.
    gpu_memory_utilization: float = 0.9
    # Speculative decoding (vLLM's names), a dict or its JSON text, e.g. {"method": "ngram", "num_speculative_tokens":
    # 4}; see rooflm.spec_decode.config.SpeculativeConfig. None: off.
    speculative_config: dict[str, Any] | str | None = None
    # Admission and preemption order: "fcfs" (first come first served), "priority" (each request's priority, lower
    # first), "mlfq" (FastServe's skip-join multi-level feedback queue), "fair" (the Virtual Token Counter over
    # the requests' users). See docs/scheduling.md.
    scheduling_policy: str = "fcfs"
    # The policies' knobs, documented and defaulted in SchedulerConfig (one source for the defaults).
    mlfq_num_levels: int = SchedulerConfig.mlfq_num_levels
    mlfq_quantum: int = SchedulerConfig.mlfq_quantum
    mlfq_skip_join_tokens: int = SchedulerConfig.mlfq_skip_join_tokens
    mlfq_starvation_steps: int = SchedulerConfig.mlfq_starvation_steps
    fair_input_weight: float = SchedulerConfig.fair_input_weight
    fair_output_weight: float = SchedulerConfig.fair_output_weight
    # "auto": the most prompt tokens a step can compute within about two decode steps' time on this machine's roofline
    # (LiveRoofline.prefill_chunk_tokens: 16 on a 2-core CPU, hundreds on a GPU, where a small prefill costs what a
    # decode step does: one read of the weights).
    priority_prefill_chunk: int | str | None = "auto"
    # How the projections are stored and multiplied (vLLM's names; rooflm.quantization.config): None (what the
    # checkpoint holds: float, GPTQ/AWQ, or a GGUF file kept quantized), "none", "w8a16", "w4a16", "gptq", "awq",
    # "gguf", "fp8".
    quantization: str | None = None
    # Engine replicas behind one server (``rooflm serve``), each with its own weights and KV cache; on CUDA replica
    # i runs on cuda:i. See rooflm.engine.data_parallel.
    data_parallel_size: int = 1
    # GiB of the decoder layers' weights kept in host memory and streamed to the device layer by layer, one layer
    # ahead of the compute (rooflm.worker.weight_offload; vLLM's name). 0: every weight on the device.
    cpu_offload_gb: float = 0.0

    # Tensor parallelism (Megatron-LM's layout, vLLM's name): the model's heads, MLP columns and vocabulary split
    # over this many processes (rank 0 is the calling process; the others are started by the engine). NCCL on CUDA
    # devices 0..N-1, gloo on the CPU. See docs/distributed.md.
    tensor_parallel_size: int = 1
    # Pipeline parallelism: the decoder layers split into this many stages. Combined with tensor parallelism the
    # engine runs tensor_parallel_size x pipeline_parallel_size processes: each stage is a tensor-parallel group.
    pipeline_parallel_size: int = 1
    # Expert parallelism (vLLM's name): a mixture-of-experts model (Mixtral) gives each of the tensor_parallel_size
    # ranks num_local_experts / tensor_parallel_size whole experts instead of a slice of every expert; attention
    # stays tensor-parallel. No effect on a dense model or on one rank. See docs/distributed.md.
    enable_expert_parallel: bool = False
    # Preemption when the KV pool runs short (vLLM's names): "recompute" frees the victim's blocks and recomputes its
    # context on resume; "swap" copies them to a host buffer of ``swap_space`` GiB and back; "auto" swaps when the
    # roofline's time to recompute the context exceeds the transfer time (rooflm.kv_cache.swap).
    preemption_mode: str = "recompute"
    swap_space: float = 4.0
    # GiB of host memory for the prefix cache's host tier (vLLM's CPU offloading, LMCache): cached blocks evicted from
    # the device pool are copied there and restored instead of recomputed (rooflm.kv_cache.host_tier). 0: off.
    kv_offload_gb: float = 0.0
    # Lossy KV compression, off by default: {"method": "streaming", "budget": tokens kept per request, "sink": 4}
    # (StreamingLLM), a dict or its JSON text; see rooflm.kv_cache.compression.KVCompressionConfig.
    kv_compression: dict[str, Any] | str | None = None
    # SLO-aware admission: a request whose predicted time to first token (the live roofline's step times over the
    # current queue; rooflm.engine.admission) exceeds this many milliseconds is refused at once. None: off.
    ttft_slo_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.cpu_offload_gb, (int, float)) or self.cpu_offload_gb < 0:
            raise _bad("EngineConfig", "cpu_offload_gb", self.cpu_offload_gb, "a number of GiB >= 0")
        if (not isinstance(self.data_parallel_size, int) or isinstance(self.data_parallel_size, bool)
                or self.data_parallel_size < 1):
            raise _bad("EngineConfig", "data_parallel_size", self.data_parallel_size, "a positive integer")
        for f in ("tensor_parallel_size", "pipeline_parallel_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise _bad("EngineConfig", f, v, "a positive integer")
        parallel = self.tensor_parallel_size * self.pipeline_parallel_size > 1
        if parallel and self.data_parallel_size > 1:
            raise _bad("EngineConfig", "data_parallel_size", self.data_parallel_size,
                       "1 with tensor or pipeline parallelism (one parallel engine per process)")
        if parallel and self.cpu_offload_gb > 0:
            raise _bad("EngineConfig", "cpu_offload_gb", self.cpu_offload_gb,
                       "0 with tensor or pipeline parallelism (offloading is for one device)")
        if parallel and self.preemption_mode != "recompute":
            raise _bad("EngineConfig", "preemption_mode", self.preemption_mode,
                       "'recompute' with tensor or pipeline parallelism (the swap copies run on rank 0 only)")
        if self.kv_compression is not None and self.speculative_config is not None:
            from rooflm.spec_decode.config import SpeculativeConfig

            if SpeculativeConfig.parse(self.speculative_config).method != "ngram":
                raise _bad("EngineConfig", "kv_compression", self.kv_compression,
                           "None with a draft model or self-speculation (the draft's cache follows uncompressed "
                           "positions)")
        if parallel and self.speculative_config is not None:
            from rooflm.spec_decode.config import SpeculativeConfig

            spec = SpeculativeConfig.parse(self.speculative_config)
            if spec.method != "ngram":
                raise _bad("EngineConfig", "speculative_config.method", spec.method,
                           "'ngram' with tensor or pipeline parallelism (a draft model runs on rank 0 only)")
        if not isinstance(self.enable_expert_parallel, bool):
            raise _bad("EngineConfig", "enable_expert_parallel", self.enable_expert_parallel, "True or False")
        if self.load_format not in LOAD_FORMATS:
            raise _bad("EngineConfig", "load_format", self.load_format, f"one of {LOAD_FORMATS}")
        if self.dtype not in ("auto",) + SUPPORTED_DTYPES:
            raise _bad("EngineConfig", "dtype", self.dtype, f"'auto' or one of {SUPPORTED_DTYPES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise _bad("EngineConfig", "kv_cache_dtype", self.kv_cache_dtype, f"one of {KV_CACHE_DTYPES}")
        if self.ops not in ("auto", "native", "triton", "cpu"):
            raise _bad("EngineConfig", "ops", self.ops, "'auto', 'native', 'triton' or 'cpu'")
        if self.attention_backend not in ("auto", "torch", "triton", "cpu"):
            raise _bad("EngineConfig", "attention_backend", self.attention_backend,
                       "'auto', 'torch', 'triton' or 'cpu'")
        from rooflm.quantization.config import QUANTIZATION_METHODS

        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise _bad("EngineConfig", "quantization", self.quantization, f"None or one of {QUANTIZATION_METHODS}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise _bad("EngineConfig", "gpu_memory_utilization", self.gpu_memory_utilization, "a number in (0, 1]")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise _bad("EngineConfig", "async_scheduling", self.async_scheduling, "True, False or None (auto)")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise _bad("EngineConfig", "preemption_mode", self.preemption_mode, f"one of {PREEMPTION_MODES}")
        if not isinstance(self.swap_space, (int, float)) or isinstance(self.swap_space, bool) or self.swap_space < 0:
            raise _bad("EngineConfig", "swap_space", self.swap_space, "a number of GiB >= 0")
        self._check_kv_offload(parallel)
        self._check_h2o(parallel)
        from rooflm.kv_cache.compression import KVCompressionConfig

        KVCompressionConfig.parse(self.kv_compression)
        if self.ttft_slo_ms is not None and (not isinstance(self.ttft_slo_ms, (int, float))
                                             or isinstance(self.ttft_slo_ms, bool) or not self.ttft_slo_ms > 0):
            raise _bad("EngineConfig", "ttft_slo_ms", self.ttft_slo_ms, "a number of milliseconds > 0, or None")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 1):
            raise _bad("EngineConfig", "max_model_len", self.max_model_len, "a positive integer or None")
        from rooflm.spec_decode.config import SpeculativeConfig

        SpeculativeConfig.parse(self.speculative_config)
        # The sub-configs validate the rest.
        self.cache_config()
        self.scheduler_config(self.max_model_len or 1)

    def _check_h2o(self, parallel: bool) -> None:
        from rooflm.kv_cache.compression import KVCompressionConfig

        comp = KVCompressionConfig.parse(self.kv_compression)
        if comp is None or comp.method != "h2o":
            return
        for name, bad, accepted in (
                ("async_scheduling", self.async_scheduling is True, "False or None with kv_compression method 'h2o' "
                 "(it drops blocks by the attention scores of the step just read back)"),
                ("kv_cache_dtype", self.kv_cache_dtype != "auto", "'auto' with kv_compression method 'h2o' (its "
                 "attention scores read the cached keys unquantized)"),
                ("tensor_parallel_size", parallel, "1 with kv_compression method 'h2o' (the scores are summed on "
                 "rank 0 only)")):
            if bad:
                raise _bad("EngineConfig", name, getattr(self, name), accepted)

    def _check_kv_offload(self, parallel: bool) -> None:
        v = self.kv_offload_gb
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise _bad("EngineConfig", "kv_offload_gb", v, "a finite number of GiB >= 0")
        if v and not self.enable_prefix_caching:
            raise _bad("EngineConfig", "kv_offload_gb", v, "0 without prefix caching (it holds evicted prefix blocks)")
        if v and parallel:
            raise _bad("EngineConfig", "kv_offload_gb", v, "0 with tensor or pipeline parallelism (the host copies "
                       "run on rank 0 only)")
        if v and self.speculative_config is not None:
            from rooflm.spec_decode.config import SpeculativeConfig

            if SpeculativeConfig.parse(self.speculative_config).method == "draft_model":
                raise _bad("EngineConfig", "kv_offload_gb", v, "0 with a draft model (its own cache is not offloaded)")

    def scheduler_config(self, max_model_len: int,
                         auto_prefill_chunk: int = SchedulerConfig.priority_prefill_chunk) -> SchedulerConfig:
        """The scheduler's share of this config: every SchedulerConfig field of the same name, with
        ``priority_prefill_chunk="auto"`` replaced by ``auto_prefill_chunk`` (the engine's roofline gives it)."""
        names = [f.name for f in fields(SchedulerConfig) if f.name != "max_model_len"]
        values = {n: getattr(self, n) for n in names}
        if values["priority_prefill_chunk"] == "auto":
            values["priority_prefill_chunk"] = auto_prefill_chunk
        return SchedulerConfig(max_model_len=max_model_len, **values)

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.block_size, self.kv_cache_memory, self.enable_prefix_caching,
                           self.num_gpu_blocks_override, kv_cache_dtype=self.kv_cache_dtype)
