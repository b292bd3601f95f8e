"""Asking kvindex over NATS: one request on ``{prefix}.lookup``, one reply per shard, merged.

The request and answer are docs/PROTOCOL.md's ``LookupRequest`` and ``LookupResponse``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
import nats.errors
from nats.aio.client import Client as NATS

from .hashing import partition


class KvindexError(Exception):
    """A lookup that got no answer to route by: route by load alone."""


class NoKvindex(KvindexError):
    """No kvindex answers under this prefix (none running, or none ready)."""


class LookupTimeout(KvindexError):
    """No shard answered in time."""


class Rejected(KvindexError):
    """kvindex could not read the request; the message says why."""


@dataclass
class Match:
    """One (worker, dp rank) holding the request's first ``blocks`` blocks on device."""

    worker_id: int
    dp_rank: int
    blocks: int
    stale: bool = False
    host: Optional[int] = None
    disk: Optional[int] = None
    predicted_blocks: Optional[int] = None
    approximate: bool = False

    @property
    def deepest(self) -> int:
        """How deep the match reaches in any tier asked, or by announcement."""
        return max(self.blocks, self.host or 0, self.disk or 0, self.predicted_blocks or 0)


@dataclass
class Group:
    """Workers with one answer: a thousand workers at one depth are one group on the wire."""

    blocks: int
    workers: List[Tuple[int, int]]
    stale: bool = False
    host: Optional[int] = None
    disk: Optional[int] = None
    predicted_blocks: Optional[int] = None
    approximate: bool = False

    def key(self) -> tuple:
        return (self.blocks, self.stale, self.host, self.disk, self.predicted_blocks, self.approximate)


@dataclass
class WorkerInfo:
    """What a publisher said its engine is."""

    name: str
    url: Optional[str] = None
    model: Optional[str] = None
    block_size: Optional[int] = None


@dataclass
class Answer:
    """Every worker holding the prefix, deepest first, and what kept the answer partial."""

    matches: List[Match]
    groups: List[Group]
    stale_workers: List[Tuple[int, int]] = field(default_factory=list)
    missing_shards: List[int] = field(default_factory=list)
    shards: int = 1
    names: Dict[int, WorkerInfo] = field(default_factory=dict)

    def best(self) -> Optional[Match]:
        """The deepest up-to-date match, if any."""
        return next((m for m in self.matches if not m.stale), None)

    @property
    def is_partial(self) -> bool:
        """Some shard did not answer: its workers are missing."""
        return bool(self.missing_shards)


def _group(g: Dict[str, Any]) -> Group:
    tiers = g.get("tiers") or {}
    return Group(
        blocks=g.get("blocks", 0),
        workers=[(int(w[0]), int(w[1])) for w in g.get("workers", [])],
        stale=bool(g.get("stale", False)),
        host=tiers.get("host"),
        disk=tiers.get("disk"),
        predicted_blocks=g.get("predicted_blocks"),
        approximate=bool(g.get("approximate", False)),
    )


def _rank(g: Group) -> int:
    return max(g.blocks, g.host or 0, g.disk or 0, g.predicted_blocks or 0)


def merge(replies: List[Dict[str, Any]], shards: int, max_matches: Optional[int]) -> Tuple[List[Group], List[Tuple[int, int]]]:
    """Shard answers merged as ``kvindex_client::shards::merge`` merges them: each worker
    believed only from the shard that owns it, deepest first, ``max_matches`` on the whole."""
    groups: List[Group] = []
    stale: List[Tuple[int, int]] = []
    for r in replies:
        shard = (r.get("shard") or {}).get("shard", 0)
        for g in map(_group, r.get("groups", [])):
            g.workers = [w for w in g.workers if shards == 1 or partition(w[0], shards) == shard]
            if g.workers:
                groups.append(g)
        for w in r.get("stale_workers", []):
            if shards == 1 or partition(w["worker_id"], shards) == shard:
                stale.append((w["worker_id"], w.get("dp_rank", 0)))
    groups.sort(key=lambda g: (-_rank(g), g.key()))
    merged: List[Group] = []
    for g in groups:
        if merged and merged[-1].key() == g.key():
            merged[-1].workers.extend(g.workers)
        else:
            merged.append(g)
    if max_matches is not None:
        room, kept = max_matches, []
        for g in merged:
            if room <= 0:
                break
            g.workers = sorted(g.workers)[:room]
            room -= len(g.workers)
            kept.append(g)
        merged = kept
    return merged, stale


class LookupClient:
    """Asks the kvindex deployment under ``prefix`` over a NATS connection.

    ``timeout``: how long to wait for every shard (100 ms by default, then answer with what
    came and name the shards that did not).
    """

    def __init__(self, nc: NATS, prefix: str = "kv", timeout: float = 0.1) -> None:
        self.nc = nc
        self.prefix = prefix
        self.timeout = timeout

    async def lookup(
        self,
        tokens: Optional[Sequence[int]] = None,
        block_size: Optional[int] = None,
        *,
        block_hashes: Optional[Sequence[int]] = None,
        lora_name: Optional[str] = None,
        salt: Optional[str] = None,
        lookahead: Optional[int] = None,
        workers: Optional[Sequence[int]] = None,
        max_blocks: Optional[int] = None,
        max_matches: Optional[int] = None,
        tiers: Optional[Sequence[str]] = None,
        names: bool = False,
        route_to: Optional[Tuple[int, int]] = None,
    ) -> Answer:
        """Which workers hold the longest prefix of a request: its ``tokens`` (with
        ``block_size``, hashed by kvindex) or its blocks' local ``block_hashes``."""
        if (tokens is None) == (block_hashes is None):
            raise ValueError("give tokens (with block_size) or block_hashes")
        req: Dict[str, Any] = {"grouped": True}
        if tokens is not None:
            if not block_size:
                raise ValueError("tokens need a block_size above 0")
            req.update(tokens=list(tokens), block_size=block_size)
            for k, v in (("lora_name", lora_name), ("salt", salt), ("lookahead", lookahead)):
                if v is not None:
                    req[k] = v
        else:
            req["block_hashes"] = [h & ((1 << 64) - 1) for h in block_hashes]
        for k, v in (("workers", workers), ("max_blocks", max_blocks), ("max_matches", max_matches), ("tiers", tiers)):
            if v is not None:
                req[k] = list(v) if isinstance(v, (list, tuple)) else v
        if names:
            req["names"] = True
        if route_to is not None:
            req["route_to"] = {"worker_id": route_to[0], "dp_rank": route_to[1]}
        # Stamped as it leaves: kvindex times the hop (kvindex_lookup_transit_seconds).
        req["sent_ns"] = time.time_ns()
        replies = await self._gather(msgpack.packb(req))
        return self._answer(replies, max_matches)

    async def _gather(self, payload: bytes) -> List[Dict[str, Any]]:
        inbox = self.nc.new_inbox()
        queue: asyncio.Queue = asyncio.Queue()

        async def on_reply(msg: Any) -> None:
            await queue.put(msg)

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            await self.nc.publish(f"{self.prefix}.lookup", payload, reply=inbox)
            await self.nc.flush()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.timeout
            replies: List[Dict[str, Any]] = []
            shards = None
            while shards is None or len({(r.get("shard") or {}).get("shard") for r in replies}) < shards:
                left = deadline - loop.time()
                if left <= 0:
                    break
                try:
                    msg = await asyncio.wait_for(queue.get(), left)
                except asyncio.TimeoutError:
                    break
                if msg.headers and msg.headers.get("Status") == "503":
                    raise NoKvindex(f"no kvindex answers on {self.prefix}.lookup")
                reply = msgpack.unpackb(msg.data, strict_map_key=False)
                if "error" in reply:
                    raise Rejected(reply["error"])
                of = reply.get("shard")
                if of is None:
                    return [reply]
                if shards is not None and of.get("shards") != shards:
                    # The partition count is changing: keep the newest count's answers.
                    replies = [r for r in replies if r["shard"].get("shards") == of.get("shards")]
                shards = of.get("shards", 1)
                replies.append(reply)
            if not replies:
                raise LookupTimeout(f"no kvindex answered on {self.prefix}.lookup within {self.timeout} s")
            return replies
        finally:
            await sub.unsubscribe()

    def _answer(self, replies: List[Dict[str, Any]], max_matches: Optional[int]) -> Answer:
        first = replies[0].get("shard")
        shards = first.get("shards", 1) if first else 1
        groups, stale = merge(replies, shards, max_matches)
        answered = {(r.get("shard") or {}).get("shard", 0) for r in replies}
        missing = [k for k in range(shards) if k not in answered] if first else []
        matches = [
            Match(w[0], w[1], g.blocks, g.stale, g.host, g.disk, g.predicted_blocks, g.approximate)
            for g in groups
            for w in sorted(g.workers)
        ]
        names = {}
        for r in replies:
            for n in r.get("names", []):
                names[n["worker_id"]] = WorkerInfo(n.get("name", ""), n.get("url"), n.get("model"), n.get("block_size"))
        return Answer(matches, groups, stale, missing, shards, names)

    async def announce(
        self,
        worker_id: int,
        dp_rank: int = 0,
        tokens: Optional[Sequence[int]] = None,
        block_size: Optional[int] = None,
        *,
        block_hashes: Optional[Sequence[int]] = None,
        lora_name: Optional[str] = None,
        salt: Optional[str] = None,
    ) -> None:
        """Says that a request was sent to ``worker_id``: kvindex holds its blocks there as
        predicted until the engine's events show them (``predicted_ttl``)."""
        msg: Dict[str, Any] = {"worker_id": worker_id, "dp_rank": dp_rank}
        if block_hashes is not None:
            msg["block_hashes"] = [h & ((1 << 64) - 1) for h in block_hashes]
        elif tokens is not None and block_size:
            msg.update(tokens=list(tokens), block_size=block_size)
            if lora_name is not None:
                msg["lora_name"] = lora_name
            if salt is not None:
                msg["salt"] = salt
        else:
            raise ValueError("give tokens (with block_size) or block_hashes")
        await self.nc.publish(f"{self.prefix}.routed.{worker_id}", msgpack.packb(msg))
