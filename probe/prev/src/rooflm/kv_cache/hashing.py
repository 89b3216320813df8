"""Chained hashes of full KV blocks, the keys of the prefix cache.

The hash of block i depends on the hash of block i-1 and on block i's own tokens, so equal hashes mean equal
*prefixes*, not just equal block contents: the same 16 tokens after a different history never collide on purpose.

Hashes are deterministic across processes and machines (sha256 over an explicit little-endian byte encoding,
truncated to 64 bits); Python's built-in ``hash`` is salted per process for str/bytes and is never used here.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["hash_block", "hash_token_blocks"]

_U64 = (1 << 64) - 1


def _encode_extra(value: object, out: bytearray) -> None:
    """Append a stable, type-tagged, length-prefixed encoding of `value` (nested tuples of scalars)."""
    if value is None:
        out += b"N"
    elif isinstance(value, bool):  # before int: bool is an int subclass
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        raw = str(value).encode()
        out += b"i" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, float):
        out += b"f" + struct.pack("<d", value)
    elif isinstance(value, str):
        raw = value.encode("utf-8")
        out += b"s" + struct.pack("<I", len(raw)) + raw
    elif isinstance(value, bytes):
        out += b"b" + struct.pack("<I", len(value)) + value
    elif isinstance(value, tuple):
        out += b"(" + struct.pack("<I", len(value))
        for item in value:
            _encode_extra(item, out)
    else:
        raise TypeError(
            f"hash_block: extra keys must be None, bool, int, float, str, bytes or tuples of those; "
            f"got {type(value).__name__}: {value!r}"
        )


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra: tuple = ()) -> int:
    """The 64-bit hash of one full block given the hash of the block before it (None for the first block).

    `extra` salts the hash with anything else the KV content depends on (e.g. an adapter id); () for none.
    """
    buf = bytearray()
    if parent_hash is None:
        buf += b"\x00"
    else:
        if not 0 <= parent_hash <= _U64:
            raise ValueError(f"hash_block: parent_hash must be a 64-bit unsigned int or None, got {parent_hash!r}")
        buf += b"\x01" + struct.pack("<Q", parent_hash)
    n = len(token_ids)
    # Token count first, so the token bytes and the extra bytes can never be confused with each other.
    buf += struct.pack(f"<I{n}q", n, *token_ids)
    if extra:
        _encode_extra(tuple(extra), buf)
    return int.from_bytes(hashlib.sha256(buf).digest()[:8], "little")


def hash_token_blocks(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of every *full* block of `token_ids` (a trailing partial block is not hashed)."""
    if block_size < 1:
        raise ValueError(f"hash_token_blocks: block_size must be a positive integer, got {block_size!r}")
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes
