"""A Python client for kvindex: ask which workers hold the longest cached prefix of a request
(over NATS, every shard merged), announce where requests went, and publish an engine's KV
events. docs/PROTOCOL.md is the contract.
"""

from .hashing import block_seed, digest, local_hashes, partition, worker_id_for_name
from .lookup import (
    Answer,
    Group,
    KvindexError,
    LookupClient,
    LookupTimeout,
    Match,
    NoKvindex,
    Rejected,
    WorkerInfo,
)
from .publisher import Publisher

__all__ = [
    "digest",
    "Answer",
    "Group",
    "KvindexError",
    "LookupClient",
    "LookupTimeout",
    "Match",
    "NoKvindex",
    "Publisher",
    "Rejected",
    "WorkerInfo",
    "block_seed",
    "local_hashes",
    "partition",
    "worker_id_for_name",
]
