"""The roofline: each operator's time is max(OPs / peak, bytes / bandwidth); stages sum their operators; a request is
prefill + every decode step with its growing cache. Pure Python (no torch), so ``rooflm analyze`` starts fast."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable

from rooflm.roofline.hardware import Hardware, get_hardware
from rooflm.roofline.ops import (Counting, Dims, OpCount, attention_ops, block_ops, kv_cache_bytes, model_ops,
                                 weight_bytes)
from rooflm.roofline.precision import DEQUANT_OPS_PER_ELEMENT, Format, Precision, compute_key, elementwise_key
from rooflm.roofline.records import AnalysisResult, LayerRecord, MemoryResult, RequestResult, StageResult, Totals

if TYPE_CHECKING:
    from rooflm.config import ModelConfig


def _positive(field: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{field}={value!r} is invalid: expected an integer >= 1")
    return value


def resolve_model(model: "str | ModelConfig") -> "ModelConfig":
    from rooflm.config import ModelConfig, load_model_config

    return model if isinstance(model, ModelConfig) else load_model_config(model)


@dataclass(frozen=True)
class _Ctx:
    """What evaluating an operator needs."""

    d: Dims
    p: Precision
    c: Counting
    hw: Hardware

    def fmt(self, role: str):
        return {"weight": self.p.weight, "act": self.p.act, "kv": self.p.kv, "high": self.p.high}[role]

    def timing(self, op: OpCount) -> tuple[float, str, str]:
        """(time_s, bound, compute key) of one operator at its roofline."""
        if op.kind == "comm":
            bw = self.hw.interconnect_bandwidth
            if bw is None:
                raise ValueError(f"tp={self.d.tp} needs an interconnect: hardware {self.hw.name!r} has no "
                                 "interconnect_gbs (add it with --device-file)")
            return op.comm_bytes / bw, "comm", "-"
        if op.kind in ("linear", "attention"):
            key = compute_key(self.fmt(op.operands[0]), self.fmt(op.operands[1]), self.hw.peak_ops)
        else:
            key = elementwise_key(self.p.act, self.hw.peak_ops)
        mem = op.load_weight + op.load_act + op.load_kv + op.store_act + op.store_kv
        t_compute = op.ops / self.hw.peak(key)
        t_memory = mem / self.hw.memory_bandwidth
        return (t_compute, "compute", key) if t_compute > t_memory else (t_memory, "memory", key)

    def record(self, op: OpCount, stage: str, scope: str, count: int) -> LayerRecord:
        time_s, bound, key = self.timing(op)
        loaded = op.load_weight + op.load_act + op.load_kv
        stored = op.store_act + op.store_kv
        mem = loaded + stored
        first = self.fmt(op.operands[0])
        # low-precision weights/KV converted to a wider compute format: reported, not added to ops
        dequant = DEQUANT_OPS_PER_ELEMENT * op.convert_elems if first.bytes < 2 and first.key != key else 0.0
        return LayerRecord(
            name=op.name, stage=stage, scope=scope, count=count, kind=op.kind, ops=op.ops,
            load_weight=op.load_weight, load_act=op.load_act, load_kv=op.load_kv, store_act=op.store_act,
            store_kv=op.store_kv, bytes_loaded=loaded, bytes_stored=stored, memory_access=mem,
            arithmetic_intensity=op.ops / mem if mem else 0.0, performance=op.ops / time_s if time_s else 0.0,
            bound=bound, time_s=time_s, compute_dtype=key, dequant_ops=dequant, comm_bytes=op.comm_bytes)


def _totals(rows: Iterable[LayerRecord]) -> Totals:
    s: dict[str, float] = dict.fromkeys(
        ("ops", "load_weight", "load_act", "load_kv", "store_act", "store_kv", "time_s", "dequant_ops",
         "comm_bytes"), 0.0)
    by_bound = {"compute": 0.0, "memory": 0.0, "comm": 0.0}
    for r in rows:
        for k in s:
            s[k] += r.count * getattr(r, k)
        by_bound[r.bound] += r.count * r.time_s
    loaded = s["load_weight"] + s["load_act"] + s["load_kv"]
    stored = s["store_act"] + s["store_kv"]
    mem = loaded + stored
    return Totals(
        ops=s["ops"], load_weight=s["load_weight"], load_act=s["load_act"], load_kv=s["load_kv"],
        store_act=s["store_act"], store_kv=s["store_kv"], bytes_loaded=loaded, bytes_stored=stored,
        memory_access=mem, arithmetic_intensity=s["ops"] / mem if mem else 0.0,
        performance=s["ops"] / s["time_s"] if s["time_s"] else 0.0, time_s=s["time_s"],
        time_compute_s=by_bound["compute"], time_memory_s=by_bound["memory"], time_comm_s=by_bound["comm"],
        dequant_ops=s["dequant_ops"], comm_bytes=s["comm_bytes"], bound=max(by_bound, key=by_bound.__getitem__))


def _stage(x: _Ctx, stage: str, batch: int, q_len: int, context: int) -> StageResult:
    rows = [x.record(op, stage, "block", x.d.layers) for op in block_ops(x.d, x.p, x.c, stage, batch, q_len, context)]
    rows += [x.record(op, stage, "model", 1) for op in model_ops(x.d, x.p, x.c, stage, batch, q_len)]
    return StageResult(stage, batch, q_len, context, rows, _totals(rows))


def _decode_steps(x: _Ctx, batch: int, input_len: int, output_len: int, ref: StageResult) -> tuple[float, float, float]:
    """Σ time, Σ ops, Σ bytes of decode steps j = 1 .. output_len-1 (step j attends to input_len + j tokens).
    Only attention depends on the context; the rest of a step is ``ref`` minus its attention rows."""
    attn_names = {op.name for op in attention_ops(x.d, x.p, x.c, "decode", batch, 1, ref.context)}
    fixed = [r for r in ref.layers if r.name not in attn_names]
    fixed_t = sum(r.count * r.time_s for r in fixed)
    fixed_ops = sum(r.count * r.ops for r in fixed)
    fixed_mem = sum(r.count * r.memory_access for r in fixed)
    t = ops = mem = 0.0
    cache: dict[int, tuple[float, float, float]] = {}
    for j in range(1, output_len):
        ctx = input_len + j
        key = ctx if x.d.window is None else min(ctx, x.d.window)  # a window caps what a step reads
        if key not in cache:
            at = am = ao = 0.0
            for op in attention_ops(x.d, x.p, x.c, "decode", batch, 1, ctx):
                at += x.timing(op)[0]
                ao += op.ops
                am += op.load_weight + op.load_act + op.load_kv + op.store_act + op.store_kv
            n = x.d.layers
            cache[key] = (fixed_t + n * at, fixed_ops + n * ao, fixed_mem + n * am)
        st, so, sm = cache[key]
        t, ops, mem = t + st, ops + so, mem + sm
    return t, ops, mem


def analyze(model: "str | ModelConfig", hardware: str | Hardware = "a6000", *, batch: int = 1, input_len: int = 2048,
            output_len: int = 256, w_bits: object = 16, a_bits: object = 16, kv_bits: object = 16,
            flash_attention: bool = False, tp: int = 1, decode_context: int | None = None,
            prefill_logits: str = "all", device_file: str | None = None,
            llm_viewer_elementwise: bool = False, expert_parallel: bool = False) -> AnalysisResult:
    """Roofline analysis of one deployment.

    model: a named config (``llama-2-7b``), a config.json / checkpoint folder / .gguf path, or a ``ModelConfig``.
    hardware: a catalog key (``a6000``, ``h100-sxm``, ...), or a ``Hardware`` (e.g. ``Hardware.from_measured``).
    batch, input_len (prompt tokens), output_len (generated tokens, >= 1: prefill gives the first).
    w_bits / a_bits / kv_bits: 32, 16, bf16, 8, fp8 or 4; w_bits and kv_bits may also be a ``Format`` whose bytes per
    element are those a quantized model's packed weights or a quantized KV cache take (scales and zero points
    included).
    tp: tensor-parallel degree (figures per GPU).
    expert_parallel: a MoE model's experts split whole over the ``tp`` GPUs instead of a slice of each on every GPU.
    decode_context: tokens the reported decode step attends to (default input_len, as in Table 1 of Yuan et al. 2024).
    prefill_logits: "all" (lm_head on every prompt token) or "last" (only the sampled positions).
    Returns ``AnalysisResult``: ``.prefill`` / ``.decode`` (rows + totals), ``.memory``, ``.request``."""
    batch = _positive("batch", batch)
    input_len = _positive("input_len", input_len)
    output_len = _positive("output_len", output_len)
    context = _positive("decode_context", input_len if decode_context is None else decode_context)
    cfg = resolve_model(model)
    hw = hardware if isinstance(hardware, Hardware) else get_hardware(hardware, device_file)
    # A Format (w_bits: a quantized model's packed weights, rooflm.quantization.apply; kv_bits: a quantized cache with
    # its per-token scales) carries the bytes per element the running engine really stores.
    p = Precision.of(16 if isinstance(w_bits, Format) else w_bits, a_bits,
                     16 if isinstance(kv_bits, Format) else kv_bits)
    if isinstance(w_bits, Format):
        p = replace(p, weight=w_bits)
    if isinstance(kv_bits, Format):
        p = replace(p, kv=kv_bits)
    x = _Ctx(Dims.of(cfg, tp, expert_parallel), p, Counting(bool(flash_attention), prefill_logits, llm_viewer_elementwise), hw)

    prefill = _stage(x, "prefill", batch, input_len, input_len)
    decode = _stage(x, "decode", batch, 1, context)

    # Memory: a peak, not a sum over steps. The cache holds prompt + generated - 1 tokens at the end.
    cached = max(input_len + output_len - 1, context)
    last = _stage(x, "decode", batch, 1, cached) if output_len > 1 else decode
    weights = weight_bytes(x.d, p)
    w_total = sum(weights.values())
    kv = kv_cache_bytes(x.d, p, batch, cached)
    act = max(r.load_act + r.store_act for s in (prefill, decode, last) for r in s.layers)
    total = w_total + kv + act
    memory = MemoryResult(weights=w_total, weights_breakdown=weights, kv_cache=kv,
                          kv_cache_tokens=cached if x.d.window is None else min(cached, x.d.window),
                          peak_activation=act, total=total, device_memory=hw.memory_bytes,
                          fits=total <= hw.memory_bytes)

    ref = _stage(x, "decode", batch, 1, input_len + 1) if output_len > 1 else decode
    dec_t, dec_ops, dec_mem = _decode_steps(x, batch, input_len, output_len, ref)
    steps = output_len - 1
    ttft = prefill.totals.time_s
    e2e = ttft + dec_t
    tpot = dec_t / steps if steps else 0.0
    request = RequestResult(
        batch=batch, input_len=input_len, output_len=output_len, decode_steps=steps, ttft_s=ttft, tpot_s=tpot,
        e2e_s=e2e, throughput_tok_s=batch * output_len / e2e, prefill_tok_s=batch * input_len / ttft,
        decode_tok_s=batch / tpot if tpot else 0.0, ops=prefill.totals.ops + dec_ops,
        memory_access=prefill.totals.memory_access + dec_mem)

    notes = []
    if not memory.fits:
        notes.append(f"does not fit: needs {total / 2**30:.1f} GiB per GPU, {hw.name} has "
                     f"{hw.memory_bytes / 2**30:.1f} GiB")
    settings: dict[str, Any] = {
        "batch": batch, "input_len": input_len, "output_len": output_len, "decode_context": context,
        "w_bits": p.weight.name, "a_bits": p.act.name, "kv_bits": p.kv.name, "flash_attention": bool(flash_attention),
        "tp": tp, "expert_parallel": bool(expert_parallel), "prefill_logits": prefill_logits, "llm_viewer_elementwise": llm_viewer_elementwise,
        "num_hidden_layers": cfg.num_hidden_layers,
    }
    return AnalysisResult(model=cfg.name or cfg.architecture, hardware=hw, settings=settings, prefill=prefill,
                          decode=decode, memory=memory, request=request, notes=notes)


def prefill_time(model: "str | ModelConfig", hardware: str | Hardware, batch: int, input_len: int,
                 **options: Any) -> float:
    """Best-possible prefill time (s) of ``batch`` prompts of ``input_len`` tokens."""
    return analyze(model, hardware, batch=batch, input_len=input_len, output_len=1, **options).prefill.time_s


def decode_step_time(model: "str | ModelConfig", hardware: str | Hardware, batch: int, context: int,
                     **options: Any) -> float:
    """Best-possible time (s) of one decode step of ``batch`` sequences attending to ``context`` tokens."""
    return analyze(model, hardware, batch=batch, input_len=context, output_len=1, decode_context=context,
                   **options).decode.time_s


def sweep(model: "str | ModelConfig", hardware: str | Hardware, *, batches: Iterable[int] = (1,),
          input_lens: Iterable[int] = (2048,), w_bits_list: Iterable[object] = (16,),
          **options: Any) -> list[AnalysisResult]:
    """One analysis per (w_bits, batch, input_len), in that nesting order (the model is resolved once)."""
    cfg = resolve_model(model)
    return [analyze(cfg, hardware, batch=b, input_len=s, w_bits=w, **options)
            for w in w_bits_list for b in batches for s in input_lens]
