"""kvindex's hashing rules, as the Rust crates apply them (docs/PROTOCOL.md, "Hashes").

A block's local hash is XXH3-64 (seed 1337) of its token ids as little-endian u32. A LoRA
adapter seeds every block, a cache salt only the first; a worker id may derive from a name;
a sharded deployment places worker ``w`` on shard FNV-1a-32(decimal w) mod S; a digest of a
set of block hashes is their count and the wrapping sum of each one mixed.
"""

from __future__ import annotations

import struct
from typing import Iterable, List, Optional, Sequence, Tuple

import xxhash

HASH_SEED = 1337
_MASK64 = (1 << 64) - 1


def block_seed(lora_name: Optional[str] = None, salt: Optional[str] = None) -> int:
    """The XXH3 seed of a block: 1337, or XXH3-64(1337, lora ++ 0x00 ++ salt)."""
    if lora_name is None and salt is None:
        return HASH_SEED
    data = (lora_name or "").encode() + b"\x00" + (salt or "").encode()
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


def hash_block_tokens(tokens: Sequence[int], seed: int = HASH_SEED) -> int:
    """The local hash of one block of token ids."""
    return xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed=seed)


def with_lookahead(local: int, ahead: Sequence[int]) -> int:
    """A block's local hash extended with the tokens after it (vLLM's lookahead hashing)."""
    data = struct.pack("<Q", local & _MASK64) + b"\xc1" + struct.pack(f"<{len(ahead)}I", *ahead)
    return xxhash.xxh3_64_intdigest(data, seed=HASH_SEED)


def local_hashes(
    tokens: Sequence[int],
    block_size: int,
    lora_name: Optional[str] = None,
    salt: Optional[str] = None,
    lookahead: int = 0,
) -> List[int]:
    """The local hashes of every full block of ``tokens`` (a partial last block is not hashed)."""
    if block_size <= 0:
        return []
    blocks = max(len(tokens) - lookahead, 0) // block_size
    seed = block_seed(lora_name, None)
    first = block_seed(lora_name, salt) if salt is not None else seed
    out = []
    for i in range(blocks):
        end = (i + 1) * block_size
        h = hash_block_tokens(tokens[end - block_size : end], first if i == 0 else seed)
        out.append(with_lookahead(h, tokens[end : end + lookahead]) if lookahead else h)
    return out


def worker_id_for_name(name: str) -> int:
    """The worker id a name stands for: XXH3-64(1337, name) >> 11 (53 bits)."""
    return xxhash.xxh3_64_intdigest(name.encode(), seed=HASH_SEED) >> 11


def partition(worker_id: int, shards: int) -> int:
    """The shard that owns ``worker_id`` among ``shards`` (NATS ``partition(S, 1)``)."""
    h = 0x811C9DC5
    for byte in str(worker_id).encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h % max(shards, 1)



def digest_mix(h: int) -> int:
    """One block hash mixed for a digest: splitmix64's finalizer, as kvindex mixes it."""
    z = (h + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def digest(block_hashes: Iterable[int]) -> Tuple[int, int]:
    """The digest of a set of block hashes (each once): ``(count, wrapping sum of their mixes)``,
    what a batch's ``digest`` carries (docs/PROTOCOL.md, "Digests")."""
    n, total = 0, 0
    for h in block_hashes:
        n += 1
        total = (total + digest_mix(h)) & _MASK64
    return n, total
