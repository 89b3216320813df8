"""Speculative decoding: a cheap proposer guesses the next k tokens, one forward pass of the target model scores all
k + 1 positions, and verification keeps the longest prefix the target agrees with plus one token of its own
(Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling"). Decode is memory-bound, so scoring k + 1 tokens costs about
as much as one: every accepted token is nearly free.

- ``config.SpeculativeConfig``: vLLM's ``speculative_config`` (method, num_speculative_tokens, ...).
- ``ngram.NgramProposer``: prompt lookup (Saxena 2023): continue the longest n-gram of the recent text that already
  occurred earlier in the prompt or output.
- ``rejection.verify``: greedy verification and rejection sampling, exact for the target's distribution.
- ``medusa``: Medusa heads on the target's last hidden state (Cai et al. 2024), chain or token-tree proposals;
  ``medusa_train``: training them on a frozen model (``rooflm train-medusa``).
- ``tree``: token trees verified in one forward pass (SpecInfer, Miao et al. 2024): shapes, the tree attention mask,
  multi-candidate verification and KV compaction.
"""
