"""A publisher and a router written from docs/PROTOCOL.md alone, against a live kvindex.

    pip install nats-py msgpack
    python3 examples/python/smoke.py [nats://127.0.0.1:4222] [prefix]

Exits non-zero if kvindex answers anything but what the protocol says.
"""
import asyncio
import sys
import time

import msgpack
import nats


async def main(url: str, prefix: str) -> None:
    nc = await nats.connect(url)
    worker, epoch = 4242, time.time_ns()
    resyncs = []

    async def on_resync(msg):
        resyncs.append(msgpack.unpackb(msg.data))

    await nc.subscribe(f"{prefix}.resync.{worker}", cb=on_resync)

    async def send(events, **extra):
        batch = {"worker_id": worker, "dp_rank": 0, "epoch": epoch, "ts_ns": time.time_ns(), "events": events, **extra}
        await nc.publish(f"{prefix}.events.{worker}", msgpack.packb(batch))
        await nc.flush()

    async def lookup(req):
        reply = await nc.request(f"{prefix}.lookup", msgpack.packb(req), timeout=2)
        return msgpack.unpackb(reply.data)

    async def expect(req, want):
        for _ in range(200):
            got = await lookup(req)
            if got == want:
                return
            await asyncio.sleep(0.02)
        raise SystemExit(f"lookup {req} answered {got}, expected {want}")

    chain = [{"block_hash": 9000 + i, "tokens_hash": 500 + i} for i in range(4)]
    await send([{"event_id": 0, "data": {"stored": {"parent_hash": None, "blocks": chain}}}])
    mine = {"workers": [worker]}
    await expect({"block_hashes": [500, 501, 502, 503], **mine},
                 {"matches": [{"worker_id": worker, "dp_rank": 0, "blocks": 4, "stale": False}]})
    # Remove a block in the middle: the match ends there.
    await send([{"event_id": 1, "data": {"removed": {"block_hashes": [9002]}}}])
    await expect({"block_hashes": [500, 501, 502, 503], **mine},
                 {"matches": [{"worker_id": worker, "dp_rank": 0, "blocks": 2, "stale": False}]})
    # Skip event id 2: the worker turns stale and is asked to resync; holding nothing, it is
    # named among the stale workers so the empty answer is not taken for a true one.
    await send([{"event_id": 3, "data": "cleared"}])
    await expect({"block_hashes": [500], **mine},
                 {"matches": [], "stale_workers": [{"worker_id": worker, "dp_rank": 0}]})
    for _ in range(100):
        if resyncs:
            break
        await asyncio.sleep(0.05)
    assert resyncs and resyncs[0] == {"worker_id": worker, "dp_rank": 0}, resyncs
    # Answer with a snapshot; the worker is fresh again.
    await send([{"event_id": 4, "data": "cleared"},
                {"event_id": 5, "data": {"stored": {"parent_hash": None, "blocks": chain[:1]}}}],
               snapshot=True, snapshot_end=True)
    await expect({"block_hashes": [500, 501], **mine},
                 {"matches": [{"worker_id": worker, "dp_rank": 0, "blocks": 1, "stale": False}]})
    # A router announces it sent a longer request to the worker (a request, so it can wait for
    # the ack): predicted until the engine's events show it; `blocks` never counts it.
    routed = {"worker_id": worker, "dp_rank": 0, "block_hashes": [500, 501, 502]}
    await nc.request(f"{prefix}.routed", msgpack.packb(routed), timeout=2)
    await expect({"block_hashes": [500, 501, 502], **mine},
                 {"matches": [{"worker_id": worker, "dp_rank": 0, "blocks": 1, "stale": False, "predicted_blocks": 3}]})
    bad = await lookup({"tokens": [1, 2, 3]})
    assert "error" in bad, bad
    await send([{"event_id": 6, "data": "cleared"}])
    await nc.close()
    print("ok: publisher and router agree with kvindex")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "nats://127.0.0.1:4222",
                     sys.argv[2] if len(sys.argv) > 2 else "kv"))
