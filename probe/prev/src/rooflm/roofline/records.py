"""Typed results of a roofline analysis. All times in seconds, bytes in bytes, OPs in operations (MAC = 2),
performance in OPs/s, arithmetic intensity in OPs/byte. Figures are per GPU when tensor parallelism is used."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rooflm.roofline.hardware import Hardware


@dataclass(frozen=True)
class LayerRecord:
    """One operator. ``count`` is how often it runs per forward pass: num_hidden_layers for per-block rows
    (``scope="block"``; the figures are for one block, as in Table 1 of Yuan et al. 2024), 1 for model-level rows."""

    name: str
    stage: str
    scope: str  # "block" | "model"
    count: int
    kind: str  # "linear" | "attention" | "elementwise" | "lookup" | "comm"
    ops: float
    load_weight: float
    load_act: float
    load_kv: float
    store_act: float
    store_kv: float
    bytes_loaded: float  # load_weight + load_act + load_kv
    bytes_stored: float  # store_act + store_kv
    memory_access: float  # bytes_loaded + bytes_stored
    arithmetic_intensity: float  # ops / memory_access (0 when nothing is moved)
    performance: float  # attainable OPs/s = ops / time_s = min(peak, intensity · bandwidth)
    bound: str  # "compute" | "memory" | "comm"
    time_s: float  # max(ops / peak, memory_access / bandwidth), or comm_bytes / interconnect
    compute_dtype: str  # which peak: fp16, int8, fp8, ...
    dequant_ops: float = 0.0  # converting low-precision weights / KV to the compute format (not in ops)
    comm_bytes: float = 0.0


@dataclass(frozen=True)
class Totals:
    """Sums over the whole model (per-block rows × num_hidden_layers + model-level rows)."""

    ops: float
    load_weight: float
    load_act: float
    load_kv: float
    store_act: float
    store_kv: float
    bytes_loaded: float
    bytes_stored: float
    memory_access: float
    arithmetic_intensity: float
    performance: float  # ops / time_s
    time_s: float  # Σ operator times: each operator at its own roofline
    time_compute_s: float  # share of time_s in compute-bound operators
    time_memory_s: float
    time_comm_s: float
    dequant_ops: float
    comm_bytes: float
    bound: str  # where most of time_s goes


@dataclass(frozen=True)
class StageResult:
    """Prefill of the whole prompt (``q_len`` = prompt length, ``context`` = prompt length) or one decode step
    (``q_len`` = 1, ``context`` = tokens attended, the new one included)."""

    stage: str
    batch: int
    q_len: int
    context: int
    layers: list[LayerRecord]
    totals: Totals

    @property
    def time_s(self) -> float:
        return self.totals.time_s

    def layer(self, name: str) -> LayerRecord:
        for r in self.layers:
            if r.name == name:
                return r
        raise KeyError(f"no operator {name!r} in {self.stage}: has {[r.name for r in self.layers]}")


@dataclass(frozen=True)
class MemoryResult:
    """Device memory of the deployment (per GPU): weights (all of them), the KV cache at the end of the request,
    and the largest temporary activations one operator holds (its inputs + outputs) in either stage."""

    weights: float
    weights_breakdown: dict[str, float]
    kv_cache: float
    kv_cache_tokens: int  # tokens per sequence held at the end (min(prompt + generated - 1, window))
    peak_activation: float
    total: float  # weights + kv_cache + peak_activation (a peak, not a sum over steps)
    device_memory: float
    fits: bool


@dataclass(frozen=True)
class RequestResult:
    """A whole request: prefill of ``input_len`` tokens (gives the first token), then ``output_len`` - 1 decode steps
    with a growing cache (step j attends to input_len + j tokens)."""

    batch: int
    input_len: int
    output_len: int
    decode_steps: int
    ttft_s: float  # prefill time
    tpot_s: float  # mean decode-step time (0 without decode steps)
    e2e_s: float  # ttft + Σ decode steps
    throughput_tok_s: float  # batch · output_len / e2e
    prefill_tok_s: float  # batch · input_len / ttft
    decode_tok_s: float  # batch / tpot (0 without decode steps)
    ops: float  # prefill + all decode steps
    memory_access: float


@dataclass(frozen=True)
class AnalysisResult:
    model: str
    hardware: Hardware
    settings: dict[str, Any]
    prefill: StageResult
    decode: StageResult
    memory: MemoryResult
    request: RequestResult
    notes: list[str] = field(default_factory=list)

    @property
    def stages(self) -> dict[str, StageResult]:
        return {"prefill": self.prefill, "decode": self.decode}

    @property
    def prefill_time_s(self) -> float:
        """Best-possible time of the prefill (seconds)."""
        return self.prefill.totals.time_s

    @property
    def decode_step_time_s(self) -> float:
        """Best-possible time of one decode step at ``settings["decode_context"]`` (seconds)."""
        return self.decode.totals.time_s

    def to_dict(self) -> dict[str, Any]:
        """The JSON schema of docs/roofline.md."""
        def stage(s: StageResult) -> dict[str, Any]:
            return {"batch": s.batch, "q_len": s.q_len, "context": s.context,
                    "layers": [asdict(r) for r in s.layers], "totals": asdict(s.totals)}

        return {
            "schema": "rooflm.roofline/1",
            "model": self.model,
            "hardware": self.hardware.to_dict(),
            "settings": dict(self.settings),
            "stages": {k: stage(v) for k, v in self.stages.items()},
            "memory": asdict(self.memory),
            "request": asdict(self.request),
            "notes": list(self.notes),
        }
