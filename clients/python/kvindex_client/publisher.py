"""Publishing an engine's KV events to kvindex (docs/PROTOCOL.md, "EventBatch"), for Python
engines and tests: each call one batch on ``{prefix}.events.{worker_id}``, heartbeats with the
digest of the device blocks held, and a snapshot of what the engine holds whenever kvindex
asks (a resync).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import msgpack
from nats.aio.client import Client as NATS

from .hashing import digest, partition, worker_id_for_name
from .lookup import WorkerInfo

TIERS = ("device", "host", "disk")
# Events per snapshot batch: well under NATS's 1 MiB default payload.
SNAPSHOT_CHUNK = 2000


class Publisher:
    """One engine's (worker id, dp rank) publisher. Start with :meth:`start`; ``stored``,
    ``removed`` and ``cleared`` publish at once; :meth:`close` stops the heartbeats.

    ``info`` names the engine (its worker id then derives from the name unless given);
    kvindex lists it and names it in answers that ask.
    """

    def __init__(
        self,
        nc: NATS,
        prefix: str = "kv",
        worker_id: Optional[int] = None,
        dp_rank: int = 0,
        info: Optional[WorkerInfo] = None,
        heartbeat: float = 1.0,
    ) -> None:
        if worker_id is None:
            if info is None:
                raise ValueError("give a worker_id or a name (info)")
            worker_id = worker_id_for_name(info.name)
        self.nc, self.prefix, self.worker_id, self.dp_rank = nc, prefix, worker_id, dp_rank
        self.info, self.heartbeat = info, heartbeat
        self.epoch = time.time_ns()
        self.next_event_id = 0
        # Per tier, what the engine holds: block hash -> (parent hash, tokens hash), in the
        # order stored.
        self.held: Dict[str, Dict[int, Tuple[Optional[int], int]]] = {t: {} for t in TIERS}
        # Whether a host or disk block was ever held: from then on heartbeats carry those
        # tiers' digests too (an engine without them sends none).
        self._tiered = False
        self._named = False
        self._subs: List[Any] = []
        self._beat: Optional[asyncio.Task] = None
        self._lock = asyncio.Lock()

    @property
    def subject(self) -> str:
        return f"{self.prefix}.events.{self.worker_id}"

    async def start(self) -> "Publisher":
        """Subscribes to resync requests and starts heartbeating."""
        self._subs.append(await self.nc.subscribe(f"{self.prefix}.resync.{self.worker_id}", cb=self._asked))
        self._subs.append(await self.nc.subscribe(f"{self.prefix}.resync", cb=self._broadcast))
        await self.nc.flush()
        self._beat = asyncio.get_running_loop().create_task(self._heartbeats())
        return self

    async def close(self) -> None:
        if self._beat:
            self._beat.cancel()
        for s in self._subs:
            await s.unsubscribe()

    async def stored(self, blocks: Sequence[Tuple[int, int]], parent: Optional[int] = None, tier: str = "device") -> None:
        """A chain of ``(block_hash, tokens_hash)`` under ``parent`` (None: from position 0)."""
        async with self._lock:
            self._tiered |= tier != "device"
            prev = parent
            for block_hash, tokens_hash in blocks:
                self.held[tier][block_hash] = (prev, tokens_hash)
                prev = block_hash
            body = {"parent_hash": parent, "tier": tier, "blocks": [{"block_hash": b, "tokens_hash": t} for b, t in blocks]}
            await self._send([{"stored": body}])

    async def removed(self, block_hashes: Sequence[int], tier: str = "device") -> None:
        async with self._lock:
            for h in block_hashes:
                self.held[tier].pop(h, None)
            await self._send([{"removed": {"block_hashes": list(block_hashes), "tier": tier}}])

    async def cleared(self) -> None:
        async with self._lock:
            for t in TIERS:
                self.held[t].clear()
            await self._send(["cleared"])

    def _digests(self) -> Dict[str, Any]:
        """The ``digest`` of the device blocks held and, once host or disk blocks were held,
        ``tier_digests`` of those two tiers (docs/PROTOCOL.md, "Digests")."""
        flags: Dict[str, Any] = {"digest": list(digest(self.held["device"]))}
        if self._tiered:
            flags["tier_digests"] = [list(digest(self.held[t])) for t in ("host", "disk")]
        return flags

    def _header(self) -> Dict[str, Any]:
        h: Dict[str, Any] = {"worker_id": self.worker_id, "dp_rank": self.dp_rank, "epoch": self.epoch, "ts_ns": time.time_ns()}
        if self.info is not None and not self._named:
            h["worker"] = {k: v for k, v in vars(self.info).items() if v is not None}
        return h

    async def _send(self, datas: List[Any], **flags: Any) -> None:
        events = []
        for d in datas:
            events.append({"event_id": self.next_event_id, "data": d})
            self.next_event_id += 1
        batch = self._header()
        batch.update(flags)
        batch["events"] = events
        batch["next_event_id"] = self.next_event_id
        await self.nc.publish(self.subject, msgpack.packb(batch))
        self._named = True

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat)
            async with self._lock:
                self._named = False  # say what the engine is once a heartbeat
                await self._send([], **self._digests())

    async def snapshot(self) -> None:
        """Sends everything held: ``cleared``, then each tier's chains parents first."""
        async with self._lock:
            datas: List[Any] = ["cleared"]
            for tier in TIERS:
                held, sent = self.held[tier], set()
                left = list(held.items())
                while left:
                    later = []
                    for h, (parent, tokens_hash) in left:
                        if parent is None or parent in sent:
                            body = {"parent_hash": parent, "tier": tier, "blocks": [{"block_hash": h, "tokens_hash": tokens_hash}]}
                            datas.append({"stored": body})
                            sent.add(h)
                        elif parent in held:
                            later.append((h, (parent, tokens_hash)))
                    if len(later) == len(left):
                        break  # parents gone: those blocks are left out
                    left = later
                # Forgotten too, so that the digest stays the digest of what kvindex holds.
                self.held[tier] = {h: v for h, v in held.items() if h in sent}
            for i in range(0, len(datas), SNAPSHOT_CHUNK):
                last = i + SNAPSHOT_CHUNK >= len(datas)
                self._named = False
                flags: Dict[str, Any] = {"snapshot": True, "snapshot_end": last}
                if last:
                    flags.update(self._digests())
                await self._send(datas[i : i + SNAPSHOT_CHUNK], **flags)

    async def _asked(self, msg: Any) -> None:
        try:
            asked = msgpack.unpackb(msg.data) if msg.data else {}
        except Exception:
            return
        if isinstance(asked, dict) and asked.get("dp_rank", 0) != self.dp_rank:
            return
        await self.snapshot()

    async def _broadcast(self, msg: Any) -> None:
        if msg.data:
            try:
                of = msgpack.unpackb(msg.data)
                if partition(self.worker_id, of["shards"]) != of["shard"]:
                    return
            except Exception:
                pass
        await self.snapshot()
