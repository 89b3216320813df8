"""Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method): when the text repeats itself (a passage being
quoted, corrected, summarised or code being edited), the tokens that followed an earlier occurrence of the last few
tokens are a good guess for the next ones. No model, no training: a search over the request's own tokens."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int = 1, max_n: int = 4) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram
        (``max_n`` down to ``min_n``) of ``token_ids``; [] when no suffix occurred before."""
        k = self.k if k is None else k
        n_tok = len(token_ids)
        if k < 1 or n_tok < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            pattern = arr[n_tok - n:]
            # Windows that start before the suffix itself and leave at least one token after them.
            windows = sliding_window_view(arr[:n_tok - 1], n)
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start:start + k].tolist()
        return []
