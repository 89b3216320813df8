"""Medusa self-distillation (Cai et al. 2024, section 2.3.2): the training sequences are the model's own greedy
continuations, the loss skips the prompt, training on them raises the heads' accuracy against the model's greedy
tokens, and bad settings are refused naming the flag."""
from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(__file__))

from medusa_models import cycling_model, random_text  # noqa: E402

from rooflm.spec_decode.medusa import MedusaHeads  # noqa: E402
from rooflm.spec_decode.medusa_distill import (
    IGNORE,
    Example,
    distilled_examples,
    prompt_windows,
)
from rooflm.spec_decode.medusa_train import (
    MedusaTrainConfig,
    encode,
    head_accuracy,
    head_losses,
    hidden_states,
    lm_head_matrix,
    pad_batch,
    train_medusa,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return cycling_model(tmp_path_factory.mktemp("tiny"), torch.float32, "cpu")


def _text(n: int, seed: int) -> list[int]:
    return random_text(n, seed)  # no BOS/EOS inside the text


def test_distilled_sequences_are_the_models_greedy_continuations(tiny):
    from rooflm import LLM, SamplingParams
    from rooflm.config import EngineConfig
    from rooflm.engine.engine import LLMEngine

    model, cfg = tiny
    text = _text(200, 0)
    def engines() -> int:
        gc.collect()
        return sum(type(o) is LLMEngine for o in gc.get_objects())

    alive = engines()
    examples, = distilled_examples(model, cfg, [(text, 4, "self_distill")], 10, 24, CPU, torch.float32)
    assert engines() == alive  # the engine and its KV pool are gone: on a GPU that memory goes to the hidden states
    prompts = prompt_windows(text, 4, 10)
    assert [e.ids[:10] for e in examples] == prompts and prompts[0] == text[:10] and prompts[-1] == text[-10:]
    assert all(e.first == 9 for e in examples)
    assert len({tuple(e.ids[10:]) for e in examples}) > 1 and all(len(set(e.ids[10:])) == 13 for e in examples)
    # a separately built engine (default settings) decoding each prompt greedily on its own
    llm = LLM.from_engine(LLMEngine(EngineConfig(device="cpu", dtype="float32", show_progress=False), model=model,
                                    model_config=cfg))
    for e, p in zip(examples, prompts):
        out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)[0]
        assert e.ids[10:] == list(out.outputs[0].token_ids)
    # and the model's argmax, one full forward pass per token (no KV cache reuse, no batching)
    lm_head = lm_head_matrix(model).float()
    geometry = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    for e in examples:
        seq = list(e.ids[:10])
        while len(seq) < 34:
            seq.append(int((hidden_states(model, *geometry, seq)[-1] @ lm_head.t()).argmax()))
        assert seq == e.ids
    # what training keeps of an example: the hidden states and labels from the prompt's last position on
    (kept_h, kept_ids), = encode(model, cfg, [examples[0]])
    torch.testing.assert_close(kept_h, hidden_states(model, *geometry, examples[0].ids)[9:])
    assert kept_ids.tolist() == [IGNORE] + examples[0].ids[10:]


def test_the_loss_skips_the_prompt_and_the_padding():
    torch.manual_seed(0)
    heads = MedusaHeads(2, 8)
    with torch.no_grad():
        heads.weight.normal_(std=0.3)
        heads.bias.normal_(std=0.3)
    lm_head = torch.randn(16, 8)
    long_ids, short_ids = torch.randint(0, 16, (20,)).tolist(), torch.randint(0, 16, (12,)).tolist()
    long_h, short_h = torch.randn(20, 8), torch.randn(12, 8)
    first = 6  # a prompt of 7 tokens

    def loss(ids_a: list[int]) -> list[torch.Tensor]:
        a, b = Example(ids_a, first), Example(short_ids, first)
        batch = pad_batch([(long_h[first:], torch.tensor(a.labels())), (short_h[first:], torch.tensor(b.labels()))])
        return head_losses(heads, lm_head, *batch)

    got = loss(long_ids)
    for i in (1, 2):  # by hand: positions t >= first of both sequences, target t + i + 1 inside each sequence
        rows, targets = [], []
        for h, ids in ((long_h, long_ids), (short_h, short_ids)):
            for t in range(first, len(ids) - i - 1):
                rows.append(h[t] + F.silu(heads.weight[i - 1] @ h[t] + heads.bias[i - 1]))
                targets.append(ids[t + i + 1])
        want = F.cross_entropy(torch.stack(rows) @ lm_head.t(), torch.tensor(targets))
        torch.testing.assert_close(got[i - 1], want)
    changed = list(long_ids)
    changed[:first + 1] = [(x + 5) % 16 for x in changed[:first + 1]]  # every prompt token
    assert all(torch.equal(a, b) for a, b in zip(loss(changed), got))
    changed = list(long_ids)
    changed[first + 2] = (changed[first + 2] + 5) % 16  # the first token head 1 is trained on
    assert not torch.equal(loss(changed)[0], got[0])
    assert Example(long_ids, first).labels()[0] == IGNORE and Example(long_ids).labels() == long_ids
    # soft labels: the model's own distribution of token t + i + 1, from the LM head at t + i, same positions
    batch = pad_batch([(long_h[first:], torch.tensor(Example(long_ids, first).labels())),
                       (short_h[first:], torch.tensor(Example(short_ids, first).labels()))])
    got = head_losses(heads, lm_head, *batch, soft=True)
    for i in (1, 2):
        rows, teacher = [], []
        for h, ids in ((long_h, long_ids), (short_h, short_ids)):
            for t in range(first, len(ids) - i - 1):
                rows.append(h[t] + F.silu(heads.weight[i - 1] @ h[t] + heads.bias[i - 1]))
                teacher.append(torch.softmax(lm_head @ h[t + i], dim=-1))
        logq = torch.log_softmax(torch.stack(rows) @ lm_head.t(), dim=-1)
        torch.testing.assert_close(got[i - 1], -(torch.stack(teacher) * logq).sum(-1).mean())


def test_accuracy_and_predicted_accepted_length_match_a_count_by_hand():
    from rooflm.spec_decode.medusa_train import predictions

    torch.manual_seed(1)
    heads = MedusaHeads(3, 8)
    with torch.no_grad():
        heads.weight.normal_()
        heads.bias.normal_()
    lm_head = torch.randn(4, 8)  # 4 tokens: a random label matches a prediction often, so runs of hits occur
    data = []
    for length in (30, 17):
        h, ids = torch.randn(length, 8), torch.randint(0, 4, (length,)).tolist()
        data.append((h, torch.tensor(Example(ids, 0).labels()), ids))
        data.append((h[5:], torch.tensor(Example(ids, 5).labels()), ids))  # the same, after a prompt of 6 tokens
    acc, chain = head_accuracy(heads, lm_head, [(h, i) for h, i, _ in data])
    right, total, runs = [0] * 4, [0] * 4, []
    for h, labels, ids in data:
        first = len(ids) - len(labels)
        pred = predictions(heads, lm_head, h).tolist()
        for t in range(len(labels)):  # position first + t of the sequence
            for j in range(4):
                target = first + t + j + 1
                if target < len(ids) and target > first:  # only tokens after the prompt are targets
                    total[j] += 1
                    right[j] += pred[j][t] == ids[target]
            if first + t + 4 < len(ids):  # head 3 (the last) has its target t + 4
                run = 0
                while run < 3 and pred[run + 1][t] == ids[first + t + run + 2]:
                    run += 1
                runs.append(run)
    assert acc == pytest.approx([r / n for r, n in zip(right, total)])
    assert chain == pytest.approx([1 + sum(min(r, k) for r in runs) / len(runs) for k in (1, 2, 3)])
    assert 0 < sum(runs) and max(runs) >= 2  # the check saw chains of more than one accepted draft


def test_self_distillation_raises_accuracy_against_the_greedy_tokens(tiny):
    model, cfg = tiny
    tc = MedusaTrainConfig(num_heads=2, steps=60, lr=3e-2, batch_size=4, seq_len=32, eval_tokens=64,
                           warmup_steps=2, log_every=60, self_distill=24, distill_len=40, distill_prompt_len=8,
                           distill_eval=6)
    lines: list[str] = []
    heads, s = train_medusa(model, cfg, _text(800, 1), _text(300, 2), tc, log=lines.append)
    before, after = s["greedy_accuracy_before"], s["greedy_accuracy_after"]
    assert after[0] == before[0] > 0.99  # the labels are the LM head's own argmax
    assert after[1] > before[1] + 0.15 and after[2] > before[2] + 0.15  # heads 1 and 2: tokens t + 2 and t + 3
    chain, chain0 = s["accepted_length"], s["accepted_length_before"]
    assert 1 <= chain[0] <= chain[1] <= 3 and chain[0] > chain0[0] + 0.15 and chain[1] > chain0[1] + 0.15
    assert len(s["accuracy_after"]) == 3  # the human-text report is still made
    assert heads.weight.device.type == "cpu"
    assert any("against the model's greedy tokens" in line for line in lines)


def test_soft_label_self_distillation_raises_accuracy_against_the_greedy_tokens(tiny):
    model, cfg = tiny
    tc = MedusaTrainConfig(num_heads=2, steps=60, lr=3e-2, batch_size=4, seq_len=32, eval_tokens=64,
                           warmup_steps=2, log_every=60, self_distill=24, distill_len=40, distill_prompt_len=8,
                           distill_eval=6, distill_soft=True)
    _, s = train_medusa(model, cfg, _text(800, 1), _text(300, 2), tc, log=lambda line: None)
    before, after = s["greedy_accuracy_before"], s["greedy_accuracy_after"]
    assert after[1] > before[1] + 0.15 and after[2] > before[2] + 0.15


def test_bad_self_distillation_settings_are_refused(tiny, tmp_path, capsys):
    from rooflm.cli import main

    with pytest.raises(ValueError, match=r"MedusaTrainConfig.self_distill=-1 \(--self-distill\)"):
        MedusaTrainConfig(self_distill=-1)
    with pytest.raises(ValueError, match=r"MedusaTrainConfig.distill_len=4 \(--distill-len\).*num_heads = 4"):
        MedusaTrainConfig(num_heads=4, self_distill=2, distill_len=4)
    with pytest.raises(ValueError, match=r"MedusaTrainConfig.distill_soft=True \(--distill-soft\).*--self-distill"):
        MedusaTrainConfig(distill_soft=True)
    with pytest.raises(ValueError, match=r"MedusaTrainConfig.num_heads=0 \(--heads\)"):
        MedusaTrainConfig(num_heads=0)
    model, cfg = tiny
    gb = 4 * 32 * cfg.hidden_size * 4 / 1e9  # 3 training windows and 1 held-out one of 32 positions, float32
    with pytest.raises(ValueError, match=rf"max_cache_gb=1e-06 \(--max-cache-gb\).*4 sequences take up to {gb:.3g} GB"):
        train_medusa(model, cfg, _text(96, 0), _text(32, 1), MedusaTrainConfig(num_heads=1, seq_len=32,
                     max_train_tokens=96, eval_tokens=32, max_cache_gb=1e-6), log=lambda s: None)
    # self-distillation is refused before it generates anything: the bound counts distill_len + 1 per continuation
    gb = ((5 + 2) * (20 + 1) + 32) * cfg.hidden_size * 4 / 1e9
    logged: list[str] = []
    with pytest.raises(ValueError, match=rf"\(--max-cache-gb\).*8 sequences take up to {gb:.3g} GB"):
        train_medusa(model, cfg, _text(96, 0), _text(32, 1), MedusaTrainConfig(
            num_heads=1, seq_len=32, eval_tokens=32, self_distill=5, distill_eval=2, distill_len=20,
            distill_prompt_len=8, max_cache_gb=1e-6), log=logged.append)
    assert not logged  # nothing generated
    out = str(tmp_path / "h")
    for argv, flag in ((["--self-distill", "0"], "--self-distill"), (["--distill-len", "x"], "--distill-len"),
                       (["--self-distill", "2", "--heads", "4", "--distill-len", "3"], "--distill-len"),
                       (["--device", "tpu"], "--device"), (["--dtype", "float8"], "--dtype"),
                       (["--distill-soft"], "--distill-soft")):
        with pytest.raises(SystemExit) as e:
            main(["train-medusa", "--out", out, *argv])
        assert e.value.code != 0 and e.value.code is not None
        message = (e.value.code if isinstance(e.value.code, str) else "") + capsys.readouterr().err
        assert flag in message, (argv, message)  # argparse names it on stderr; the config's checks in the exit text


def test_unwrap_lines_joins_each_paragraph_and_keeps_every_word():
    """train-medusa's default data preparation: the shipped excerpts are hard-wrapped at about 72 columns; each
    paragraph becomes one line, and the words and their order do not change."""
    from importlib import resources

    from rooflm.spec_decode.cli import unwrap_lines

    assert unwrap_lines("A b\nc d.\n\n\n  E\n f.\n \nG") == "A b c d.\n\nE f.\n\nG"
    text = (resources.files("rooflm") / "bench" / "data" / "austen_emma.txt").read_text()
    out = unwrap_lines(text)
    assert out.split() == text.split()
    paragraphs = out.split("\n\n")
    assert len(paragraphs) > 100 and all("\n" not in p for p in paragraphs)
    assert max(len(line) for line in text.splitlines()) < 80 < max(len(p) for p in paragraphs)
