"""The model runner: turns a ``SchedulerOutput`` into one forward pass and samples, without waiting for the device.

All tokens scheduled in a step are packed into one flat batch with no padding:
``input_ids``/``positions``/``slot_mapping`` are ``[num_tokens]``; the attention metadata says where each request's
tokens start and how long its context is. Logits are computed only where they are needed: the last token of a
chunk that reaches the end of its request's tokens (to sample), or every prompt position when prompt logprobs are
asked.

``execute`` returns a ``StepHandle`` as soon as the step's work is queued on the device; ``StepHandle.get()`` waits
for it and reads the results back. Sampled ids also stay on the device (``InputBatch.last_token``), where the next
step's inputs are gathered from, so the engine can schedule and prepare step N+1 while step N runs.
"""
from __future__ import annotations

from collections.abc import Collection

import numpy as np
import torch
from torch import nn

from rooflm.attention.backend import AttentionMetadata
from rooflm.attention.kv_quant import allocate_kv_cache, copy_blocks, kv_bytes_per_token_head, kv_cache_nbytes
from rooflm.config import ModelConfig
from rooflm.engine.sched_output import ModelRunnerOutput, SchedulerOutput
from rooflm.engine.stop_checker import banned_token_ids
from rooflm.layers.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs, logprobs_to_dicts
from rooflm.spec_decode.tree import attention_mask, tree_depths
from rooflm.worker.input_batch import CachedRequestState, InputBatch, upload


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V of every layer for ``block_size`` tokens (with their scales when ``kv_cache_dtype`` quantizes)."""
    per = kv_bytes_per_token_head(cfg.head_dim, dtype, kv_cache_dtype)
    return cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * per


class StepHandle:
    """One step's results, still on the device until ``get()``. ``req_ids``: the sampling requests in batch order;
    ``plain_ids`` sampled one token each (``sampled``, with logprobs when asked), ``spec_ids`` verified draft tokens
    (``spec_tokens`` [R, K + 1] padded with -1, ``spec_accepted`` [R]); ``on_spec`` receives each verified request's
    number of accepted draft tokens once they are on the host."""

    def __init__(self, req_ids: list[str], plain_ids: list[str], sampled: torch.Tensor | None,
                 lp_ids: torch.Tensor | None, lp_vals: torch.Tensor | None, want_logprobs: list[int | None],
                 prompt_lp: list[tuple[str, list[int], int, torch.Tensor, torch.Tensor]], device: torch.device,
                 spec_ids: list[str] = (), spec_tokens: torch.Tensor | None = None,
                 spec_accepted: torch.Tensor | None = None, on_spec=None,
                 drafts: dict[str, list[int]] | None = None) -> None:
        self.req_ids = req_ids
        self._drafts = drafts or {}
        self._plain_ids = plain_ids
        self._spec_ids = list(spec_ids)
        self._want = want_logprobs
        self._on_spec = on_spec
        self._result: ModelRunnerOutput | None = None
        self._event = None
        self.block_scores: dict[str, list[float]] = {}  # H2O's per-block attention scores, already on the host
        pin = device.type == "cuda"
        # Start the device-to-host copies now (pinned, non-blocking); get() waits on one event.
        self._sampled = _to_host(sampled, pin)
        self._lp_ids = _to_host(lp_ids, pin)
        self._lp_vals = _to_host(lp_vals, pin)
        self._spec_tokens = _to_host(spec_tokens, pin)
        self._spec_accepted = _to_host(spec_accepted, pin)
        self._plp = [(rid, pos, k, _to_host(i, pin), _to_host(v, pin)) for rid, pos, k, i, v in prompt_lp]
        if pin:
            self._event = torch.cuda.Event()
            self._event.record()

    def get(self) -> ModelRunnerOutput:
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
        tokens: dict[str, list[int]] = {}
        if self._sampled is not None:
            tokens.update((rid, [t]) for rid, t in zip(self._plain_ids, self._sampled.tolist()))
        if self._spec_ids:
            accepted = self._spec_accepted.tolist()
            for rid, row, a in zip(self._spec_ids, self._spec_tokens.tolist(), accepted):
                tokens[rid] = row[:a + 1]
            self._on_spec(self._spec_ids, accepted)
        out = ModelRunnerOutput(self.req_ids, [tokens[rid] for rid in self.req_ids], draft_token_ids=self._drafts,
                                block_scores=self.block_scores)
        if self._lp_ids is not None:
            dicts = logprobs_to_dicts(self._lp_ids, self._lp_vals, [k or 0 for k in self._want])
            chosen = self._lp_vals[:, 0].tolist()
            by_id = {rid: (d if k is not None else None, c if k is not None else None)
                     for rid, d, c, k in zip(self._plain_ids, dicts, chosen, self._want)}
            out.logprobs = [by_id.get(rid, (None, None))[0] for rid in self.req_ids]
            out.sampled_logprobs = [by_id.get(rid, (None, None))[1] for rid in self.req_ids]
        for rid, positions, k, ids, vals in self._plp:
            dicts = logprobs_to_dicts(ids, vals, [k] * len(positions))  # the actual prompt token always present
            out.prompt_logprobs.setdefault(rid, []).extend((p + 1, d) for p, d in zip(positions, dicts))
        self._result = out
        return out


def _to_host(t: torch.Tensor | None, pin: bool) -> torch.Tensor | None:
    if t is None or not pin:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class ModelRunner:
    def __init__(self, model: nn.Module, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: torch.device, dtype: torch.dtype, max_num_seqs: int, max_model_len: int,
                 eos_token_ids: Collection[int] = (), kv_cache_dtype: str = "auto") -> None:
        self.model = model
        self.cfg = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv_cache_dtype = kv_cache_dtype
        # One cache per layer: [2, num_blocks, block_size, num_kv_heads, head_dim] in the model's dtype, or a
        # QuantizedKVCache (int8 / fp8 values of that shape and their per-token-and-head scales)
        self.kv_caches = [allocate_kv_cache(num_blocks, block_size, model_config.num_key_value_heads,
                                            model_config.head_dim, dtype, kv_cache_dtype, device)
                          for _ in range(model_config.num_hidden_layers)]
        self.max_blocks_per_seq = min(num_blocks, -(-max_model_len // block_size))
        self.batch = InputBatch(max_num_seqs, self.max_blocks_per_seq, model_config.vocab_size, device)
        self.sampler = Sampler()
        self._pin = device.type == "cuda"  # pinned host buffers for the per-step inputs
        for m in model.modules() if device.type == "cuda" else ():  # cos / sin looked up each step, bit-equal
            if hasattr(m, "use_device_table"):  # (RotaryEmbedding)
                m.use_device_table(max_model_len + 64, dtype)  # margin: a verify step's drafts past the last token
        self.num_block_copies = 0
        # the previous step's sampling parameters (the requests' own objects) and metadata: an unchanged batch
        # reuses its device tensors (SamplingMetadata.from_params)
        self._last_sampling: tuple[list, SamplingMetadata | None] = ([], None)
        self.graph_runner = None  # decode CUDA graphs (worker/cuda_graphs.py), set by capture_graphs()
        self.drafter = None  # a model-based speculative proposer (spec_decode/drafter.py), set by the engine
        self.swap_space = None  # HostSwapSpace (worker/swap_space.py) under swap preemption
        self.kv_offload = None  # HostSwapSpace of the prefix cache's host tier (worker/kv_offload.py)

    def capture_graphs(self, max_num_seqs: int, num_speculative_tokens: int = 0) -> None:
        """Capture decode CUDA graphs, and verify graphs for chains of up to ``num_speculative_tokens`` drafts (the
        runner's one graph-or-eager choice is made per step in ``execute``)."""
        from rooflm.worker.cuda_graphs import capture_decode_graphs

        self.graph_runner = capture_decode_graphs(self, max_num_seqs, num_speculative_tokens)

    # -- state ------------------------------------------------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.batch.remove(rid)
        for rid in out.preempted_req_ids:
            self.batch.remove(rid)
        if self.drafter is not None:
            self.drafter.forget(out.finished_req_ids | out.preempted_req_ids)
        for new in out.new_reqs:
            self.batch.add(new.req_id, new.token_ids, new.num_prompt_tokens, new.params, new.generator,
                           new.block_ids, new.num_computed_tokens)
        for rid, ranges in out.kv_dropped.items():  # before the new blocks are appended
            for start, n in ranges:
                self.batch.drop_blocks(rid, start, n, self.block_size)
        for c in out.cached_reqs:
            self.batch.append_blocks(c.req_id, c.new_block_ids)

    # -- inputs -----------------------------------------------------------------------------------------------------
    def _prepare(self, out: SchedulerOutput):
        bs = self.block_size
        reqs = self.batch.reqs
        sampling = set(out.sampling_req_ids)
        states: list[CachedRequestState] = []
        input_ids: list[int] = []
        positions: list[int] = []
        starts = [0]
        seq_lens: list[int] = []  # context lengths in the cache (KV compression: dropped positions excluded)
        dropped: list[int] = []
        rows: list[int] = []
        dev_idx: list[int] = []  # flat positions whose token is the row's last sampled one (still on the device)
        dev_rows: list[int] = []
        sample_idx: list[int] = []  # flat index of the last token of each sampling request without draft tokens
        spec_idx: list[int] = []  # flat indices of every position of the requests verifying draft tokens
        rope_at: dict[int, tuple[int, list[int]]] = {}  # token trees: sequence -> (first flat index, RoPE positions)
        tree_masks: dict[int, torch.Tensor] = {}
        for rid, n in out.num_scheduled_tokens.items():
            s = reqs[rid]
            start, end = s.num_computed_tokens, s.num_computed_tokens + n
            known = len(s.token_ids)
            spec = out.scheduled_spec_tokens.get(rid, [])
            if start >= known:  # a decode of the token sampled last (gathered on the device), then any drafts
                if n != 1 + len(spec):
                    raise RuntimeError(f"request {rid!r}: {n} tokens scheduled past its {known} known tokens")
                dev_idx.append(len(input_ids))
                dev_rows.append(s.row)
                input_ids.append(0)
                input_ids += spec
                positions += range(start, end)
                parents = self.drafter.tree_for(rid, spec) if spec and hasattr(self.drafter, "tree_for") else None
                if parents is not None:  # a token tree: RoPE positions by depth, the tree's attention mask
                    rope_at[len(seq_lens)] = (len(positions) - n, tree_depths(parents, start))
                    tree_masks[len(seq_lens)] = attention_mask(parents, self.device)
            else:
                input_ids += s.token_ids[start:end]
                positions += range(start, end)
            starts.append(len(input_ids))
            seq_lens.append(end - s.num_dropped)
            dropped.append(s.num_dropped)
            rows.append(s.row)
            if rid in sampling:
                if end != s.num_tokens + len(spec):
                    raise RuntimeError(f"request {rid!r} samples at {end} but holds {s.num_tokens} tokens")
                if spec:
                    spec_idx += range(len(input_ids) - n, len(input_ids))
                else:
                    sample_idx.append(len(input_ids) - 1)
            states.append(s)
        n_seq = len(states)
        table = self.batch.block_table[rows]  # [n_seq, max_blocks]
        width = max(1, -(-max(seq_lens) // bs))
        table = table[:, :width]
        seq_of_tok = np.repeat(np.arange(n_seq), np.diff(np.asarray(starts)))
        pos = np.asarray(positions, dtype=np.int64) - np.asarray(dropped, dtype=np.int64)[seq_of_tok]  # cache index
        slots = table[seq_of_tok, pos // bs] * bs + pos % bs
        rope = positions
        if rope_at:  # slots stay consecutive (``positions``); the rotary embedding takes each node's depth
            rope = list(positions)
            for first, depth_pos in rope_at.values():
                rope[first:first + len(depth_pos)] = depth_pos
        i64, i32 = np.int64, np.int32
        ids, pos_t, slot_mapping, d_idx, d_rows, rows_t, qsl, lens, tbl = upload(
            [np.asarray(input_ids, i64), np.asarray(rope, i64), slots.astype(i64, copy=False),
             np.asarray(dev_idx, i64), np.asarray(dev_rows, i64), np.asarray(rows, i64), np.asarray(starts, i32),
             np.asarray(seq_lens, i32), table.astype(i32).ravel()], self.device, self._pin)
        if dev_idx:
            ids.index_copy_(0, d_idx, self.batch.last_token.index_select(0, d_rows))
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=qsl,
            seq_lens=lens,
            block_tables=tbl.view(n_seq, width),
            max_query_len=max(starts[i + 1] - starts[i] for i in range(n_seq)),
            max_seq_len=max(seq_lens),
            query_start_loc_cpu=starts,
            seq_lens_cpu=seq_lens,
            tree_masks=[tree_masks.get(i) for i in range(n_seq)] if tree_masks else None,
        )
        return states, ids, pos_t, meta, sample_idx, spec_idx, rows_t

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self.num_block_copies += len(pairs)
        src = torch.tensor([p[0] for p in pairs], device=self.device)
        dst = torch.tensor([p[1] for p in pairs], device=self.device)
        extra = self.drafter.kv_caches if self.drafter is not None and self.drafter.owns_cache else []
        for cache in self.kv_caches + extra:
            copy_blocks(cache, src, dst)

    # -- one step -----------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepHandle:
        self._update_states(out)
        # device blocks are read (offloads, swap-outs) before any is written (swap-ins, restores): a block freed
        # this step may already be handed out again
        if self.kv_offload is not None:
            self.kv_offload.run(self.kv_caches, out.kv_offload_out, [])
        if self.swap_space is not None:
            self.swap_space.run(self.kv_caches, out.blocks_to_swap_out, out.blocks_to_swap_in)
        if self.kv_offload is not None:
            self.kv_offload.run(self.kv_caches, [], out.kv_offload_in)
        self._copy_blocks(out.blocks_to_copy)
        states, ids, pos, meta, sample_idx, spec_idx, rows_t = self._prepare(out)
        if out.attn_score_req_ids:
            from rooflm.attention.h2o_scores import BlockScoreCollector

            batch_index = {rid: i for i, rid in enumerate(out.num_scheduled_tokens)}
            meta.attn_scores = BlockScoreCollector([(r, batch_index[r]) for r in out.attn_score_req_ids],
                                                   self.block_size, meta.block_tables, meta.query_start_loc_cpu,
                                                   meta.seq_lens_cpu)
        graph_logits = None
        if self.graph_runner is not None and meta.attn_scores is None and self.graph_runner.can_run(meta):
            hidden = self.graph_runner.run(ids, pos, meta)
            graph_logits = self.graph_runner.logits  # [num_tokens, vocab]: the LM head is in the graph too
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta)  # [num_tokens, hidden]
        if self.drafter is not None:
            self.drafter.mirror(ids, pos, meta)
        prompt_lp = self._prompt_logprobs(states, out, hidden, meta)

        sample_set = set(out.sampling_req_ids)
        plain_pos = [i for i, s in enumerate(states) if s.req_id in sample_set and s.req_id not in
                     out.scheduled_spec_tokens]
        plain = [states[i] for i in plain_pos]
        spec = [s for s in states if s.req_id in out.scheduled_spec_tokens]
        for s in states:
            s.num_computed_tokens += out.num_scheduled_tokens[s.req_id]
        req_ids = [s.req_id for s in states if s.req_id in sample_set]
        so = None
        head_logits = None
        if plain:
            if graph_logits is not None and len(plain) == len(states) and self.graph_runner.query_len == 1:
                logits = graph_logits  # a decode step: one row per request, every request samples
                rows = rows_t
            else:
                sampled_hidden = hidden[torch.tensor(sample_idx, device=self.device)]
                if hasattr(self.drafter, "fused_logits"):  # Medusa: the heads' rows in the same LM head product
                    logits, head_logits = self.drafter.fused_logits(sampled_hidden)
                else:
                    logits = self.model.compute_logits(sampled_hidden)
                rows = rows_t if len(plain) == len(states) else rows_t[torch.tensor(plain_pos, device=self.device)]
            md, penalty_rows, penalty_index = self._sampling_metadata(plain, rows, out)
            so = self.sampler(logits, md)  # [num_plain, vocab] float32 logits -> one token each
            for st in plain:
                st.num_tokens += 1
            self.batch.record_sampled(rows, so.sampled_token_ids, penalty_rows, penalty_index)
            # Medusa heads draft from the hidden state that sampled; only a drafting step needs it (and a pipelined
            # step must not wait for its forward pass, as observe's row count does)
            if hasattr(self.drafter, "observe") and self.drafter.enabled:
                self.drafter.observe(rows, hidden[torch.tensor(sample_idx, device=self.device)], head_logits)
        # a verify graph scored every token of the step; when every token is a verified one, its logits are the rows
        verify_logits = (graph_logits if graph_logits is not None and self.graph_runner.query_len > 1
                         and len(spec_idx) == len(ids) else None)
        spec_out = self._verify(spec, out, hidden, spec_idx, verify_logits) if spec else (None, None)
        drafts = self._draft(plain, spec, spec_out[1]) if self.drafter is not None else None
        handle = StepHandle(req_ids, [s.req_id for s in plain], so.sampled_token_ids if so else None,
                            so.logprob_token_ids if so else None, so.logprobs if so else None,
                            [s.params.logprobs for s in plain], prompt_lp, self.device,
                            [s.req_id for s in spec], spec_out[0], spec_out[1], self._spec_verified, drafts)
        if meta.attn_scores is not None:
            handle.block_scores = meta.attn_scores.to_lists()
        return handle

    def _draft(self, plain: list[CachedRequestState], spec: list[CachedRequestState],
               accepted: torch.Tensor | None) -> dict[str, list[int]]:
        """Draft tokens for the next step, from the tokens this step produced (waits for the verification)."""
        from rooflm.spec_decode.drafter import DraftRequest, draftable

        newest = [(s, s.num_tokens - 1) for s in plain]  # num_tokens already counts the sampled token
        if spec:
            newest += [(s, s.num_tokens + a) for s, a in zip(spec, accepted.tolist())]
        reqs = []
        for s, p in newest:
            outputs = p + 1 - s.num_prompt_tokens  # output tokens once this step's are counted
            if draftable(s.params) and outputs >= s.params.min_tokens:
                left = None if s.params.max_tokens is None else s.params.max_tokens - outputs - 1
                reqs.append(DraftRequest(s.req_id, s.row, p, s.block_ids, s.params, s.generator, left))
        return self.drafter.propose(reqs, self.batch.last_token)

    def _verify(self, spec: list[CachedRequestState], out: SchedulerOutput, hidden: torch.Tensor,
                spec_idx: list[int], logits: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Score every position of the requests with draft tokens and keep what the target model accepts."""
        from rooflm.spec_decode.rejection import verify

        drafts = [out.scheduled_spec_tokens[s.req_id] for s in spec]
        head_logits = None
        # every token of the step is a verified one (a single speculative request, say): the rows as they are
        scored = (hidden if len(spec_idx) == hidden.shape[0] and spec_idx[-1] == len(spec_idx) - 1
                  else hidden[torch.tensor(spec_idx, device=self.device)])
        if logits is None and hasattr(self.drafter, "fused_logits"):  # Medusa: the heads' rows in the same product
            logits, head_logits = self.drafter.fused_logits(scored)
        elif logits is None:
            logits = self.model.compute_logits(scored)  # [S, vocab]
        greedy = [s.params.greedy or s.params.top_k == 1 for s in spec]
        md = None  # the sampling parameters of every scored row: only sampled requests read them
        if not all(greedy):
            params = [s.params for s in spec for _ in range(len(out.scheduled_spec_tokens[s.req_id]) + 1)]
            md = SamplingMetadata.from_params(params, [[]] * len(params), [[]] * len(params), [None] * len(params),
                                              self.device)
        q = ([self.drafter.draft_probs(s.req_id, d) for s, d in zip(spec, drafts)] if self.drafter is not None
             else None)
        trees = [self.drafter.tree_for(s.req_id, d) for s, d in zip(spec, drafts)] if hasattr(
            self.drafter, "tree_for") else []
        if any(t is not None for t in trees):  # token trees (spec_decode/tree.py); a chain is a tree too
            trees = [t if t is not None else tuple(range(len(d))) for t, d in zip(trees, drafts)]
            tokens, accepted, last = self.drafter.verify_trees(logits, md, spec, drafts, trees, self.kv_caches,
                                                               self.block_size)
        else:
            tokens, accepted = verify(logits, drafts, md, greedy, [s.generator for s in spec], q)
            last = accepted
        for s, d in zip(spec, drafts):
            s.pending_spec = d
        rows = torch.tensor([s.row for s in spec], device=self.device)
        self.batch.last_token.index_copy_(0, rows, tokens.gather(1, accepted.unsqueeze(1)).squeeze(1))
        if hasattr(self.drafter, "observe"):  # Medusa: the hidden state of each request's last accepted position
            firsts = np.cumsum([0] + [len(d) + 1 for d in drafts[:-1]]).tolist()
            # host lists where the counts are on the host: a few small tensor operators fewer per step
            picked = (torch.tensor([f + a for f, a in zip(firsts, last.tolist())]) if last.device.type == "cpu"
                      else torch.tensor(firsts, device=self.device) + last)
            self.drafter.observe(rows, scored[picked], None if head_logits is None else head_logits[picked])
        return tokens, accepted

    def _spec_verified(self, req_ids: list[str], accepted: list[int]) -> None:
        """Host bookkeeping once verification results are read: each request kept ``a`` draft tokens and one more."""
        for rid, a in zip(req_ids, accepted):
            s = self.batch.reqs.get(rid)
            if s is not None:
                s.num_computed_tokens -= len(s.pending_spec) - a
                s.num_tokens += a + 1
                s.pending_spec = []

    def _sampling_metadata(self, sampling: list[CachedRequestState], rows: torch.Tensor, out: SchedulerOutput):
        params = [s.params for s in sampling]
        # Banned ids while under min_tokens: decided by the runner's own count of sampled tokens (the scheduler's
        # host copy may lag a step behind under asynchronous scheduling). A grammar decides alone when its output
        # may end (banning EOS where the grammar allows only EOS would leave nothing to sample).
        grammar = set(out.grammar_req_ids)
        banned = [[] if s.req_id in grammar else banned_token_ids(s.num_output_tokens, s.params, self.eos_token_ids)
                  for s in sampling]
        penalty_pos = [i for i, s in enumerate(sampling) if s.penalties]
        penalty_rows = [sampling[i].row for i in penalty_pos]
        penalty_index = counts = mask = None
        if penalty_pos:
            penalty_index = torch.tensor(penalty_pos, device=self.device)
            counts = self.batch.output_counts.index_select(0, rows)  # [N, V]; rows without penalties ignore it
            mask = self.batch.prompt_mask.index_select(0, rows)
        empty = [[] for _ in sampling]
        prev_params, prev_md = self._last_sampling
        same = len(prev_params) == len(params) and all(a is b for a, b in zip(prev_params, params))
        md = SamplingMetadata.from_params(params, empty, empty, [s.generator for s in sampling], self.device, banned,
                                          output_token_counts=counts, prompt_token_mask=mask,
                                          reuse=prev_md if same else None)
        self._last_sampling = (params, md)
        if grammar:
            md.allowed_token_bitmask = self._batch_bitmask(sampling, out)
        return md, penalty_rows, penalty_index

    def _batch_bitmask(self, sampling: list[CachedRequestState], out: SchedulerOutput) -> torch.Tensor:
        """The step's bitmask for every sampled row (all ones where no grammar applies), one non-blocking copy."""
        src = out.grammar_bitmask
        host = torch.full((len(sampling), src.shape[1]), -1, dtype=torch.int32, pin_memory=self._pin)
        at = {rid: i for i, rid in enumerate(out.grammar_req_ids)}
        for i, s in enumerate(sampling):
            j = at.get(s.req_id)
            if j is not None:
                host[i] = src[j]
        return host.to(self.device, non_blocking=True)

    def _prompt_logprobs(self, states: list[CachedRequestState], out: SchedulerOutput, hidden: torch.Tensor,
                         meta: AttentionMetadata) -> list:
        """Prompt token p (>= 1) gets log P(prompt[p] | prompt[:p]) from the hidden state at position p - 1."""
        result = []
        for i, s in enumerate(states):
            if s.params.prompt_logprobs is None:
                continue
            start = s.num_computed_tokens
            positions = list(range(start, min(start + out.num_scheduled_tokens[s.req_id], s.num_prompt_tokens - 1)))
            if not positions:
                continue
            rows = torch.tensor([meta.query_start_loc_cpu[i] + p - start for p in positions], device=self.device)
            targets = torch.tensor([s.token_ids[p + 1] for p in positions], device=self.device)
            k = s.params.prompt_logprobs or 0
            ids, vals = compute_prompt_logprobs(self.model.compute_logits(hidden[rows]), targets, k)
            result.append((s.req_id, positions, k, ids, vals))
        return result


@torch.inference_mode()
def profile_activation_bytes(model: nn.Module, cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                             block_size: int, device: torch.device, dtype: torch.dtype,
                             kv_cache_dtype: str = "auto") -> int:
    """Peak device memory, beyond what is allocated now, of one forward pass over ``max_num_batched_tokens`` prompt
    tokens plus the logits and sampling of ``max_num_seqs`` rows: the activation room the KV pool must leave free.
    The scratch KV cache of the pass is not counted (the real pool replaces it)."""
    from rooflm.attention.metadata_utils import build_attention_metadata

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    num_tokens = max_num_batched_tokens
    num_blocks = -(-num_tokens // block_size)
    caches = [allocate_kv_cache(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, kv_cache_dtype,
                                device) for _ in range(cfg.num_hidden_layers)]
    cache_bytes = sum(kv_cache_nbytes(c) for c in caches)
    meta, positions = build_attention_metadata([list(range(num_blocks))], [0], [num_tokens], block_size, device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    hidden = model(ids, positions, caches, meta)
    rows = hidden[-1:].expand(max_num_seqs, -1).contiguous()
    logits = model.compute_logits(rows)
    torch.softmax(logits, dim=-1).argmax(dim=-1)  # the sampler's [rows, vocab] float32 temporaries
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base - cache_bytes
    del caches, hidden, logits, rows
    torch.cuda.empty_cache()
    return max(0, int(peak))
