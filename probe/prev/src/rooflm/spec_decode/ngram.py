"""Prompt lookup decoding (Saxena 2023; vLLM's ``ngram`` method): when the text repeats itself (a passage being
quoted, corrected, summarised or code being edited), the tokens that followed an earlier occurrence of the last few
tokens are a good guess for the next ones. No model, no training: a lookup over the request's own tokens.

``NgramIndex`` keeps, per n, the most recent start of every n-gram that has a token after it; appending a token
adds one n-gram per n, so a step costs O(max_n) per request whatever the context length (a scan over the whole
text each step cost milliseconds per request at a 1k context)."""
from __future__ import annotations


class NgramIndex:
    """The n-grams (min_n <= n <= max_n) of one growing token list, each mapped to its most recent start."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        self.num_indexed = 0  # tokens seen (the caller's list may be the same object, grown in place)
        self._starts: dict[tuple[int, ...], int] = {}

    def extend(self, token_ids: list[int]) -> None:
        """Catch up with ``token_ids`` (the same list as before, grown at its end)."""
        for length in range(self.num_indexed + 1, len(token_ids) + 1):
            # The token at length - 1 now follows the n-grams that end just before it.
            for n in range(self.min_n, self.max_n + 1):
                start = length - 1 - n
                if start >= 0:
                    self._starts[tuple(token_ids[start:start + n])] = start
        self.tokens = token_ids
        self.num_indexed = len(token_ids)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
        tokens, total = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = self._starts.get(tuple(tokens[total - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, min_n: int = 2, max_n: int = 4) -> None:
        self.k = num_speculative_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, token_ids: list[int], k: int | None = None, req_id: str | None = None) -> list[int]:
        """Up to ``k`` tokens that followed the most recent earlier occurrence of the longest suffix n-gram
        (``max_n`` down to ``min_n``) of ``token_ids``; [] when no suffix occurred before. With ``req_id`` the index
        of that request is kept and extended from one call to the next."""
        k = self.k if k is None else k
        if k < 1:
            return []
        index = self._indexes.get(req_id) if req_id is not None else None
        if index is None or index.num_indexed > len(token_ids):
            index = NgramIndex(self.min_n, self.max_n)
            if req_id is not None:
                self._indexes[req_id] = index
        index.extend(token_ids)
        return index.propose(k)

    def retain(self, req_ids: set[str]) -> None:
        """Forget the indexes of requests not in ``req_ids`` (finished or preempted)."""
        for rid in [r for r in self._indexes if r not in req_ids]:
            del self._indexes[rid]
