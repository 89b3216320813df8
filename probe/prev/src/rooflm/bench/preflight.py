"""What a benchmark will cost, said before anything loads: the memory the weights and the KV pool take and the time
the roofline predicts on this machine's measured ceilings, from the model's config alone (``rooflm.roofline``).

A run that cannot fit the free memory is refused; one the roofline predicts to take longer than ``LONG_RUN_S`` (a
7B model on a CPU: minutes per iteration) needs ``--yes``. The roofline's time is a lower bound, so a refused run
would have taken at least that long. Progress notes go to stderr, so stdout keeps the report (or the JSON/CSV)."""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

from rooflm.units import duration, size

LONG_RUN_S = 300.0


def note(message: str) -> None:
    """A progress message on stderr (model init, warm-up): the user sees why nothing happens yet."""
    print(f"[rooflm bench] {message}", file=sys.stderr, flush=True)


def add_yes_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--yes", action="store_true",
                   help=f"run even when the roofline predicts more than {LONG_RUN_S:.0f} s for the whole benchmark")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model``, ``--load-format``, ``--dtype``, ``--device`` with the GPU defaults (``bench throughput`` and
    ``bench multiturn``; the CLI swaps in the CPU defaults the help names when no GPU is present)."""
    p.add_argument("--model", default="llama-2-7b", help="named config, checkpoint folder or .gguf (default: the "
                   "embedded SmolLM2-135M GGUF without a GPU, llama-2-7b with one)")
    p.add_argument("--load-format", default="dummy", help="auto, dummy (random weights), safetensors, gguf "
                   "(default: dummy with a GPU, auto without)")
    p.add_argument("--dtype", default="float16",
                   help="float16, bfloat16 or float32 (default: float16 with a GPU, float32 without)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """``-tp``, ``-pp`` and ``--enable-expert-parallel``, as the engine's options (``bench latency`` / ``throughput``)."""
    p.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many GPUs (or CPU processes); decode CUDA graphs stay on where the "
                        "small all-reduces run one-shot over peer memory (CUDA)")
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="split the decoder layers into this many stages; with -tp, tp x pp GPUs (or CPU processes)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="mixture-of-experts models: each of the -tp ranks holds whole experts instead of a slice of "
                        "every expert")


def available_memory(device_type: str) -> int | None:
    """Bytes free for a new model: MemAvailable on the CPU (Linux), the free device memory on CUDA; None: unknown."""
    if device_type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class Estimate:
    weights_bytes: float
    kv_bytes: float
    tpot_s: float  # best possible time per output token of the batch (roofline on the measured ceilings)
    run_s: float  # best possible time of every iteration (warm-up included)

    @property
    def memory_bytes(self) -> float:
        return self.weights_bytes + self.kv_bytes


_QUANT_BITS = {"w8a16": "8", "w4a16": "4", "gptq": "4", "awq": "4", "fp8": "fp8"}


def weight_bits(dtype: str, quantization: str | None) -> str:
    """The analyzer's weight format of a run: the quantization's bits, else the dtype's."""
    return _QUANT_BITS.get(quantization or "", {"float32": "32", "bfloat16": "bf16"}.get(dtype, "16"))


def estimate(cfg, ceilings: dict, w_bits: str, batch: int, input_len: int, output_len: int, iterations: int,
             kv_bytes: float, kv_bits: object = "16") -> Estimate | None:
    """The run's memory and best-possible time; None when the roofline cannot model the architecture."""
    try:
        b = roofline_bounds(cfg, ceilings, batch, input_len, output_len, w_bits=w_bits, kv_bits=kv_bits)
    except (ValueError, KeyError, NotImplementedError):
        return None
    if b is None:
        return None
    one = b["ttft_s"] + max(0, output_len - 1) * b["tpot_s"]
    return Estimate(b["weights_bytes"], kv_bytes, b["tpot_s"], one * iterations)


def check(est: Estimate | None, available: int | None, yes: bool, model: str) -> None:
    """Say what the run costs; refuse (ValueError naming --model) a run that cannot fit, or a long one without
    ``--yes``."""
    if est is None:
        return
    note(f"{model}: weights {size(est.weights_bytes)} + KV cache {size(est.kv_bytes)}; the roofline predicts "
         f"TPOT >= {duration(est.tpot_s)} and >= {duration(est.run_s)} for every iteration here")
    if available is not None and est.memory_bytes > available:
        raise ValueError(f"--model {model}: needs about {size(est.memory_bytes)} (weights {size(est.weights_bytes)} "
                         f"+ KV cache {size(est.kv_bytes)}) but {size(available)} is free; pick a smaller model, "
                         "--dtype or --quantization")
    if est.run_s > LONG_RUN_S and not yes:
        raise ValueError(f"--model {model}: the roofline predicts at least {duration(est.run_s)} for this benchmark "
                         f"on this machine (TPOT >= {duration(est.tpot_s)}); pass --yes to run it anyway")


def kv_format(head_dim: int, model_dtype: str, kv_cache_dtype: str = "auto") -> object:
    """The analyzer's KV format of a run: the model dtype's bits for ``auto``, else int8 / fp8 with the bytes per
    element the cache really stores (one float32 scale per token and head beside the 1-byte values)."""
    if kv_cache_dtype in (None, "auto"):
        return weight_bits(model_dtype, None)
    import torch

    from rooflm.attention.kv_quant import kv_bytes_per_token_head
    from rooflm.roofline.precision import Format

    per_elem = kv_bytes_per_token_head(head_dim, torch.float16, kv_cache_dtype) / (2 * head_dim)
    int8 = kv_cache_dtype == "int8"
    return Format(f"{kv_cache_dtype}+scales", "int8" if int8 else "fp8", per_elem, int8)


def roofline_bounds(cfg, ceilings: dict, batch: int, input_len: int, output_len: int, w_bits: object = 16,
                    kv_bits: object = 16, expert_parallel_size: int = 1) -> dict | None:
    """Best-possible TTFT / TPOT and the bytes and FLOPs they imply, from rooflm.roofline on the measured ceilings.
    ``w_bits``: the projection weights' format (a quantized model's ``rooflm.quantization.apply.weight_format``);
    ``kv_bits``: the KV cache's (``kv_format``). ``expert_parallel_size`` > 1 (a MoE model's experts split whole
    over that many GPUs) adds ``ep_tpot_s``: one GPU's best TPOT under that split, each layer waiting for the GPU
    whose experts the step touched most, collectives free."""
    try:
        from rooflm.roofline import Hardware, analyze
    except ImportError:
        return None
    peak = ceilings["matmul_tflops"]
    # measured ceilings carry no link figure: a split model's collectives count as free (a lower bound)
    hw = Hardware.from_measured(ceilings["copy_gbps"], {"fp16": peak, "bf16": peak, "fp32": peak / 2},
                                memory_gib=1024, interconnect_gbs=float("inf"), name=f"measured {ceilings['device']}")
    r = analyze(cfg, hw, batch=batch, input_len=input_len, output_len=output_len, flash_attention=True,
                prefill_logits="last", w_bits=w_bits, kv_bits=kv_bits)
    steps = max(1, output_len - 1)
    out = {"ttft_s": r.request.ttft_s, "tpot_s": r.request.tpot_s,
           "decode_step_bytes": (r.request.memory_access - r.prefill.totals.memory_access) / steps,
           "prefill_ops": r.prefill.totals.ops, "weights_bytes": r.memory.weights}
    if expert_parallel_size > 1 and cfg.is_moe:
        try:
            e = analyze(cfg, hw, batch=batch, input_len=input_len, output_len=output_len, flash_attention=True,
                        prefill_logits="last", w_bits=w_bits, kv_bits=kv_bits, tp=expert_parallel_size,
                        expert_parallel=True)
        except ValueError:  # heads the analyzer cannot split evenly: no such bound, the even split stands alone
            return out
        out["ep_tpot_s"] = e.request.tpot_s
    return out
