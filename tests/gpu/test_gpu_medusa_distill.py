"""Medusa self-distillation on the GPU: generation, hidden states and training all run on CUDA (bfloat16 model), the
heads come back on the CPU, and `rooflm train-medusa --device cuda --self-distill` writes heads that load on the CPU.
Skipped without CUDA."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))

from medusa_models import cycling_model, random_text as _text  # noqa: E402


def test_self_distillation_trains_on_cuda_and_returns_cpu_heads(tmp_path):
    from rooflm.spec_decode.medusa import (
        load_medusa_heads,
        model_identity,
        save_medusa_heads,
    )
    from rooflm.spec_decode.medusa_train import MedusaTrainConfig, train_medusa

    model, cfg = cycling_model(tmp_path, torch.bfloat16, "cuda")
    tc = MedusaTrainConfig(num_heads=2, steps=60, lr=3e-2, batch_size=4, seq_len=32, eval_tokens=64,
                           warmup_steps=2, log_every=60, self_distill=24, distill_len=40, distill_prompt_len=8,
                           distill_eval=6)
    heads, s = train_medusa(model, cfg, _text(800, 1), _text(300, 2), tc, log=lambda line: None)
    before, after = s["greedy_accuracy_before"], s["greedy_accuracy_after"]
    assert after[0] > 0.95  # the labels are the model's own argmax (bfloat16 decode against prefill: near ties)
    assert after[1] > before[1] + 0.15 and after[2] > before[2] + 0.15
    assert heads.weight.device.type == "cpu" and heads.weight.dtype == torch.float32
    save_medusa_heads(heads, tmp_path / "h", model_identity(cfg, "tiny"))
    loaded, _ = load_medusa_heads(tmp_path / "h", cfg, device="cpu")
    assert torch.equal(loaded.weight, heads.weight)


def test_train_medusa_command_on_cuda_writes_heads_that_load_on_the_cpu(tmp_path, capsys):
    from rooflm.cli import main
    from rooflm.config import load_model_config
    from rooflm.spec_decode.medusa import load_medusa_heads

    out = tmp_path / "heads"
    # the embedded model's GGUF file, where its package is not installed (a GPU machine without a package index)
    model = ["--model", os.environ["ROOFLM_TEST_GGUF"]] if os.environ.get("ROOFLM_TEST_GGUF") else []
    rc = main(["train-medusa", *model, "--device", "cuda", "--self-distill", "8", "--distill-len", "32", "--distill-eval",
               "2", "--steps", "4", "--batch-size", "4", "--log-every", "2", "--eval-tokens", "256", "--heads", "3",
               "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "against the model's greedy tokens" in text and "on cuda" in text
    heads, meta = load_medusa_heads(out, load_model_config("smollm2-135m"), device="cpu")
    assert meta["num_heads"] == 3 and heads.weight.device.type == "cpu"
    assert heads.weight.abs().sum() > 0  # trained: the heads start at zero
