"""The client against a live kvindex, driven by tests/python_client.rs (which starts
nats-server and the daemons): ``live.py NATS_URL PREFIX SHARDS``.

One shard: named and numbered publishers, lookups by tokens and hashes with every option, the
hashing rules checked against kvindex's own (it hashes the tokens), an announcement, a
resync healed by the publisher's snapshot, a lost host-tier event found by its digest. Two shards: the merged answer is every worker's;
after printing ``whole`` it waits for a line on stdin (shard 1 stopped), then expects shard 1
named missing and shard 0's workers kept.
"""

import asyncio
import sys

import nats

from kvindex_client import LookupClient, NoKvindex, Publisher, WorkerInfo, digest, local_hashes, partition, worker_id_for_name


async def until(check, what, secs=20.0):
    """Polls ``check`` (async, truthy when done) under a generous deadline."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + secs
    last = None
    while loop.time() < deadline:
        try:
            last = await check()
        except NoKvindex as e:
            last = e
        if last and not isinstance(last, Exception):
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: never; last {last!r}")


def depth(answer, worker):
    return next(((m.blocks, m.stale) for m in answer.matches if m.worker_id == worker), None)


async def one_shard(nc, prefix):
    lookups = LookupClient(nc, prefix, timeout=2.0)
    prompt = list(range(1, 17))
    locals_ = local_hashes(prompt, 4)
    # Cross-checks with the Rust crates' values.
    assert worker_id_for_name("llama-0") == 3256072243310924, worker_id_for_name("llama-0")
    assert [partition(w, 3) for w in range(6)] == RUST_PARTITIONS, [partition(w, 3) for w in range(6)]
    assert digest([1, 2, 3]) == (3, 0x456D78AF809B437C), digest([1, 2, 3])

    a = await Publisher(nc, prefix, info=WorkerInfo("py-a", url="http://10.0.0.1:8000", block_size=4), heartbeat=0.2).start()
    b = await Publisher(nc, prefix, worker_id=7, heartbeat=0.2).start()
    await a.stored([(100 + i, h) for i, h in enumerate(locals_)])
    await b.stored([(200 + i, h) for i, h in enumerate(locals_)], tier="host")
    await b.stored([(200 + i, h) for i, h in enumerate(locals_[:2])])
    sql = local_hashes(prompt, 4, lora_name="sql")
    await b.stored([(300 + i, h) for i, h in enumerate(sql)])
    salted = local_hashes(prompt, 4, salt="tenant-a")
    await b.stored([(400 + i, h) for i, h in enumerate(salted[:3])])

    async def both():
        ans = await lookups.lookup(prompt, 4)
        return ans if depth(ans, a.worker_id) == (4, False) and depth(ans, 7) == (2, False) else None

    ans = await until(both, "both publishers' blocks")
    assert [m.worker_id for m in ans.matches] == [a.worker_id, 7], ans.matches
    assert ans.best().worker_id == a.worker_id
    # kvindex hashed the tokens; these hashes are the client's: the same answer.
    by_hash = await lookups.lookup(block_hashes=locals_)
    assert [(m.worker_id, m.blocks) for m in by_hash.matches] == [(a.worker_id, 4), (7, 2)], by_hash.matches
    lora = await lookups.lookup(prompt, 4, lora_name="sql")
    assert [(m.worker_id, m.blocks) for m in lora.matches] == [(7, 4)], lora.matches
    salt = await lookups.lookup(prompt, 4, salt="tenant-a")
    assert [(m.worker_id, m.blocks) for m in salt.matches] == [(7, 3)], salt.matches
    named = await lookups.lookup(prompt, 4, names=True)
    assert named.names[a.worker_id] == WorkerInfo("py-a", "http://10.0.0.1:8000", None, 4), named.names
    tiers = await lookups.lookup(prompt, 4, tiers=["device", "host"])
    assert next(m for m in tiers.matches if m.worker_id == 7).host == 4, tiers.matches
    only = await lookups.lookup(prompt, 4, workers=[7])
    assert [m.worker_id for m in only.matches] == [7]
    one = await lookups.lookup(prompt, 4, max_matches=1)
    assert [m.worker_id for m in one.matches] == [a.worker_id]
    few = await lookups.lookup(prompt, 4, max_blocks=1)
    assert [m.blocks for m in few.matches] == [1, 1], few.matches
    assert not ans.is_partial and ans.shards == 1

    # An announcement: kvindex predicts the longer request at worker 7 beside what it holds.
    longer = prompt + list(range(100, 108))
    await lookups.announce(7, 0, longer, 4)

    async def predicted():
        ans = await lookups.lookup(longer, 4)
        m = next((m for m in ans.matches if m.worker_id == 7), None)
        return m if m and m.predicted_blocks == 6 and m.blocks == 2 else None

    await until(predicted, "the announced blocks predicted")

    # A lost batch (ids skipped): kvindex asks for a resync; the snapshot makes it whole.
    a.next_event_id += 5
    await a.removed([103])

    async def healed():
        ans = await lookups.lookup(prompt, 4)
        return ans if depth(ans, a.worker_id) == (3, False) else None

    await until(healed, "worker a whole again after its snapshot")

    # A host-tier event lost on the way (held, never sent): only the host tier's digest shows
    # it; kvindex flags worker 7 drifted, asks for a snapshot, and then holds the block.
    longest = prompt + list(range(20, 24))
    fifth = local_hashes(longest, 4)[4]
    b.held["host"][204] = (203, fifth)

    async def host_healed():
        ans = await lookups.lookup(longest, 4, tiers=["device", "host"])
        m = next((m for m in ans.matches if m.worker_id == 7), None)
        return m if m and m.host == 5 and not m.stale else None

    await until(host_healed, "worker 7's lost host block found by its tier digest and healed")
    for p in (a, b):
        await p.close()


async def two_shards(nc, prefix):
    lookups = LookupClient(nc, prefix, timeout=2.0)
    prompt = list(range(1, 33))
    locals_ = local_hashes(prompt, 4)
    pubs = []
    for w in range(6):
        p = await Publisher(nc, prefix, worker_id=w, heartbeat=0.2).start()
        await p.stored([(1000 * (w + 1) + i, h) for i, h in enumerate(locals_[: w + 1])])
        pubs.append(p)
    want = {w: w + 1 for w in range(6)}

    async def whole():
        ans = await lookups.lookup(prompt, 4)
        got = {m.worker_id: m.blocks for m in ans.matches}
        return ans if got == want and not ans.missing_shards else None

    ans = await until(whole, "every shard's workers")
    assert ans.shards == 2 and [m.blocks for m in ans.matches] == sorted(want.values(), reverse=True), ans.matches
    two = await lookups.lookup(prompt, 4, max_matches=2)
    assert [m.worker_id for m in two.matches] == [5, 4], two.matches
    print("whole", flush=True)
    sys.stdin.readline()  # shard 1 stopped
    kept = {w: d for w, d in want.items() if partition(w, 2) == 0}

    async def partial():
        ans = await lookups.lookup(prompt, 4)
        return ans if ans.missing_shards == [1] and {m.worker_id: m.blocks for m in ans.matches} == kept else None

    await until(partial, "shard 1 named missing, shard 0's workers kept")
    for p in pubs:
        await p.close()


async def main():
    url, prefix, shards = sys.argv[1], sys.argv[2], int(sys.argv[3])
    nc = await nats.connect(url)
    await (two_shards(nc, prefix) if shards == 2 else one_shard(nc, prefix))
    await nc.close()
    print("ok", flush=True)


RUST_PARTITIONS = [int(x) for x in sys.argv[4].split(",")] if len(sys.argv) > 4 else []

if __name__ == "__main__":
    asyncio.run(main())
