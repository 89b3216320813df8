"""Roofline analysis of LLM inference (LLM-Viewer of Yuan et al. 2024, "LLM Inference Unveiled", corrected and
extended): per-operator OPs, bytes, arithmetic intensity, bound and best-possible time; memory; whole-request
latency. Pure Python; plots and the ``--measure`` probe import matplotlib / torch lazily.

    from rooflm.roofline import analyze, Hardware
    r = analyze("llama-2-7b", "a6000", batch=1, input_len=2048)
    r.prefill_time_s, r.decode_step_time_s, r.request.tpot_s
    r = analyze("llama-3-8b", Hardware.from_measured(bandwidth_gbs=3000, peak_tflops=800), batch=8)
"""
from __future__ import annotations

from rooflm.roofline.analyzer import analyze, decode_step_time, prefill_time, sweep
from rooflm.roofline.hardware import Hardware, get_hardware, list_hardware, load_device_file
from rooflm.roofline.ops import Counting, Dims, OpCount
from rooflm.roofline.records import AnalysisResult, LayerRecord, MemoryResult, RequestResult, StageResult, Totals

__all__ = [
    "analyze", "decode_step_time", "prefill_time", "sweep", "Hardware", "get_hardware", "list_hardware",
    "load_device_file", "Counting", "Dims", "OpCount", "AnalysisResult", "LayerRecord", "MemoryResult",
    "RequestResult", "StageResult", "Totals",
]
