"""``StructuredOutputManager``: the engine-side state of constrained decoding.

One llguidance matcher per scheduled request (``n > 1`` children each get their own, from one compiled grammar).
Each step, after the scheduler decides, ``attach_bitmask`` computes on the host the allowed-token bitmask of every
request that samples with a grammar (``[G, ceil(V / 32)]`` int32, bit ``t % 32`` of word ``t // 32`` set when token
``t`` is allowed) and puts it in the ``SchedulerOutput``; the runner copies it to the device once and the sampler
applies it as one masked fill. After the step, ``accept`` advances each matcher with the tokens the scheduler
accepted. EOS is in the mask only where the grammar accepts the output so far, so a constrained output ends exactly
when it is complete.

Asynchronous scheduling: the mask of a request's next token depends on its previous token, which is still on the
device while the next step is being scheduled. The scheduler therefore does not schedule a request with a grammar
while it has an output placeholder (``Scheduler.schedule``); such a request decodes every other step under
asynchronous scheduling, and plain requests in the same batch are unaffected.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rooflm.logger import get_logger
from rooflm.structured.backend import LLGuidanceBackend
from rooflm.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from rooflm.engine.sched_output import EngineCoreOutput, SchedulerOutput

logger = get_logger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], pin_memory: bool = False,
                 cache_size: int = 256) -> None:
        if tokenizer is None:
            raise ValueError("SamplingParams.structured_outputs needs the model's tokenizer; this model has none "
                             "(dummy weights)")
        self.backend = LLGuidanceBackend(tokenizer, vocab_size, eos_token_ids, cache_size)
        self.eos_token_ids = list(eos_token_ids)
        self.pin_memory = pin_memory
        self.matchers: dict[str, Any] = {}
        self._failed: set[str] = set()

    # -- requests ----------------------------------------------------------------------------------------------------
    def compile(self, spec: StructuredOutputsParams) -> None:
        """Check ``spec`` (ValueError naming the field when the backend refuses it); the grammar is cached."""
        self.backend.compile(spec)

    def add_request(self, req_id: str, spec: StructuredOutputsParams) -> None:
        self.matchers[req_id] = self.backend.matcher(spec)

    def remove(self, req_ids: Iterable[str]) -> None:
        for rid in req_ids:
            self.matchers.pop(rid, None)
            self._failed.discard(rid)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.matchers

    def __len__(self) -> int:
        return len(self.matchers)

    # -- one step ----------------------------------------------------------------------------------------------------
    def fill_bitmask(self, req_ids: Sequence[str]) -> torch.Tensor:
        """[len(req_ids), ceil(V / 32)] int32 host tensor (pinned on CUDA): the tokens each request may sample next."""
        mask = torch.zeros(len(req_ids), self.backend.bitmask_words, dtype=torch.int32, pin_memory=self.pin_memory)
        healthy = []
        for i, rid in enumerate(req_ids):
            m = self.matchers[rid]
            if rid in self._failed or m.is_error():
                self._allow_only_eos(mask[i])
            else:
                healthy.append((m, i))
        self.backend.fill_masks(healthy, mask)
        return mask

    def _allow_only_eos(self, row: torch.Tensor) -> None:
        row.zero_()
        words = row.numpy().view(np.uint32)
        for t in self.eos_token_ids:
            word, bit = divmod(t, 32)
            if word < words.shape[0]:
                words[word] |= np.uint32(1 << bit)

    def attach_bitmask(self, out: "SchedulerOutput") -> None:
        """Set ``out.grammar_req_ids`` / ``out.grammar_bitmask`` for the requests that sample with a grammar."""
        if not self.matchers:
            return
        rids = [r for r in out.sampling_req_ids if r in self.matchers and r not in out.scheduled_spec_tokens]
        if rids:
            out.grammar_req_ids = rids
            out.grammar_bitmask = self.fill_bitmask(rids)

    def accept(self, outputs: Iterable["EngineCoreOutput"]) -> None:
        """Advance each matcher with its request's new tokens; drop the matchers of finished requests."""
        if not self.matchers:
            return
        for o in outputs:
            m = self.matchers.get(o.req_id)
            if m is None:
                continue
            if o.finished:
                self.remove([o.req_id])
                continue
            if o.new_token_ids and not m.consume_tokens(o.new_token_ids):
                # Cannot happen for tokens sampled under the mask; if it does, end the output at once (EOS only)
                # rather than let it leave the grammar.
                logger.error("request %s: the grammar refused tokens %s (%s); ending its output", o.req_id,
                             o.new_token_ids, m.get_error())
                self._failed.add(o.req_id)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """[N, V] logits, [N, W] int32 bitmask on the same device -> logits with disallowed tokens at -inf, as one masked
    fill (rows whose words are all -1 are unchanged, bit for bit). No host synchronisation."""
    n, v = logits.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    allowed = bits.reshape(n, -1)[:, :v].bool()
    if allowed.shape[1] < v:  # columns past the mask (none when W = ceil(V / 32))
        allowed = torch.nn.functional.pad(allowed, (0, v - allowed.shape[1]), value=False)
    return logits.masked_fill(~allowed, float("-inf"))
