"""The model runner: turns a ``SchedulerOutput`` into one forward pass and samples.

All tokens scheduled in a step are packed into one flat batch with no padding:
``input_ids``/``positions``/``slot_mapping`` are ``[num_tokens]``; the attention metadata says where each sequence's
tokens start and how long its context is. Logits are computed only where they are needed: the last token of a
chunk that reaches the end of its sequence (to sample), or every prompt position when prompt logprobs are asked.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from rooflm.attention.backend import AttentionMetadata
from rooflm.config import ModelConfig
from rooflm.engine.sched_output import ScheduledSeq, SchedulerOutput
from rooflm.layers.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs, logprobs_to_dicts


@dataclass
class SeqResult:
    sampled: list[int] = field(default_factory=list)  # one token per row
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per row, when asked
    sampled_logprobs: list[float] = field(default_factory=list)  # per row: logprob of the sampled token
    # prompt logprobs of the chunk: (prompt position, {token: logprob}) for positions >= 1
    prompt_logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of every layer for ``block_size`` tokens."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.cfg = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        # One tensor per layer: [2, num_blocks, block_size, num_kv_heads, head_dim]
        shape = (2, num_blocks, block_size, model_config.num_key_value_heads, model_config.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=dtype, device=device)
                          for _ in range(model_config.num_hidden_layers)]
        self.sampler = Sampler()
        self._pin = device.type == "cuda"  # pinned host buffers for the per-step inputs
        self.num_block_copies = 0  # copy-on-write copies done (n > 1 samples sharing a partly filled block)
        self.graph_runner = None  # set by the CUDA-graph capture for decode steps (worker/cuda_graphs.py)

    # -- inputs -----------------------------------------------------------------------------------------------------
    def _prepare(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        n_seq = len(scheduled)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        max_blocks = max(len(s.block_ids) for s in scheduled)
        tables = np.zeros((n_seq, max_blocks), dtype=np.int64)  # padded with block 0
        for i, s in enumerate(scheduled):
            start, table = s.num_computed_tokens, s.block_ids
            end = start + s.num_new_tokens
            input_ids += s.token_ids
            if end - start == 1:  # a decode: the common case, kept cheap
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            starts.append(starts[-1] + end - start)
            seq_lens.append(end)
            tables[i, : len(table)] = table
        # One host buffer, one host-to-device copy (pinned on CUDA, so it does not stall the host):
        # [input_ids | positions | slot_mapping | query_start_loc | seq_lens | block_tables (row-major)]
        n_tok = len(input_ids)
        host = torch.from_numpy(np.concatenate(
            [np.array(input_ids + positions + slots + starts + seq_lens, dtype=np.int64), tables.ravel()]))
        if self._pin:
            host = host.pin_memory()
        flat = host.to(self.device, non_blocking=True)
        ids, pos, slot_mapping, qsl, lens, tbl = flat.split([n_tok, n_tok, n_tok, n_seq + 1, n_seq, n_seq * max_blocks])
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=qsl.to(torch.int32),
            seq_lens=lens.to(torch.int32),
            block_tables=tbl.view(n_seq, max_blocks).to(torch.int32),
            max_query_len=max(s.num_new_tokens for s in scheduled),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
        )
        return ids, pos, meta

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self.num_block_copies += len(pairs)
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    # -- one step -----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, SeqResult]:
        self._copy_blocks(out.blocks_to_copy)
        scheduled = out.scheduled
        ids, pos, meta = self._prepare(scheduled)
        graph_logits = None
        if self.graph_runner is not None and self.graph_runner.can_run(meta):
            hidden = self.graph_runner.run(ids, pos, meta)
            graph_logits = self.graph_runner.logits  # [num_seqs, vocab]: the LM head is in the graph too (issue 5)
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta)  # [num_tokens, hidden]

        results: dict[str, SeqResult] = {s.seq_id: SeqResult() for s in scheduled}
        self._prompt_logprobs(scheduled, hidden, meta, results)

        # Sampling rows: the last token of every chunk that reaches its sequence's end (repeated for forks).
        sample_seqs = [(i, s) for i, s in enumerate(scheduled) if s.sample]
        if not sample_seqs:
            return results
        if graph_logits is not None and len(sample_seqs) == len(scheduled):
            logits = graph_logits  # a decode step: one row per sequence, every sequence samples
        else:
            last_idx = torch.tensor([meta.query_start_loc_cpu[i + 1] - 1 for i, _ in sample_seqs],
                                    device=self.device)
            logits = self.model.compute_logits(hidden[last_idx])  # [num_sampling_seqs, vocab] float32
        if any(len(s.generators) > 1 for _, s in sample_seqs):  # decided on the host: no device sync (issue 5)
            reps = torch.tensor([len(s.generators) for _, s in sample_seqs], device=self.device)
            logits = logits.repeat_interleave(reps, dim=0)
        rows = [(s, r) for _, s in sample_seqs for r in range(len(s.generators))]
        md = SamplingMetadata.from_params(
            [s.params for s, _ in rows],
            output_token_ids=[s.output_token_ids[r] for s, r in rows],
            prompt_token_ids=[s.prompt_token_ids for s, _ in rows],
            generators=[s.generators[r] for s, r in rows],
            device=self.device,
            banned_token_ids=[s.ban_token_ids for s, _ in rows],  # EOS / stop ids while under min_tokens
        )
        so = self.sampler(logits, md)
        tokens = so.sampled_token_ids.tolist()
        want = [s.params.logprobs for s, _ in rows]
        lp_dicts = None
        if so.logprobs is not None:
            lp_dicts = logprobs_to_dicts(so.logprob_token_ids, so.logprobs, [k or 0 for k in want])
            chosen_lp = so.logprobs[:, 0].tolist()
        for row, (s, _) in enumerate(rows):
            res = results[s.seq_id]
            res.sampled.append(tokens[row])
            if lp_dicts is not None and want[row] is not None:
                res.logprobs.append(lp_dicts[row])
                res.sampled_logprobs.append(chosen_lp[row])
        return results

    def _prompt_logprobs(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor, meta: AttentionMetadata,
                         results: dict[str, SeqResult]) -> None:
        """Prompt token p (>= 1) gets log P(prompt[p] | prompt[:p]) from the hidden state at position p - 1."""
        for i, s in enumerate(scheduled):
            if not s.prompt_logprobs:
                continue
            prompt = s.prompt_token_ids
            start = s.num_computed_tokens
            positions = range(start, min(start + s.num_new_tokens, len(prompt) - 1))
            if not positions:
                continue
            rows = torch.tensor([meta.query_start_loc_cpu[i] + p - start for p in positions], device=self.device)
            targets = torch.tensor([prompt[p + 1] for p in positions], device=self.device)
            k = s.params.prompt_logprobs or 0
            ids, vals = compute_prompt_logprobs(self.model.compute_logits(hidden[rows]), targets, k)
            dicts = logprobs_to_dicts(ids, vals, [k] * len(positions))  # the actual prompt token always present
            results[s.seq_id].prompt_logprobs.extend((p + 1, d) for p, d in zip(positions, dicts))
