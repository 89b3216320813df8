"""Distributed inference: tensor parallelism (``parallel_state``, ``partition``) with worker processes started and
driven by rank 0 (``executor``, ``worker``), and pipeline parallelism (``pipeline``). See docs/distributed.md."""
