"""A stand-in engine to try a router against: ``engine.py NATS_URL PREFIX NAME URL TOKEN...``
publishes the blocks of one prompt (16-token blocks) as engine NAME serving at URL, then keeps
heartbeating until interrupted, so that kvindex answers for it.
"""

import asyncio
import sys

import nats

from kvindex_client import Publisher, WorkerInfo, local_hashes


async def main() -> None:
    url, prefix, name, engine_url, *tokens = sys.argv[1:]
    nc = await nats.connect(url)
    pub = await Publisher(nc, prefix, info=WorkerInfo(name, url=engine_url, block_size=16)).start()
    hashes = local_hashes([int(t) for t in tokens], 16)
    # The engine's own block hashes are its business: any distinct numbers do here.
    await pub.stored([(i + 1, h) for i, h in enumerate(hashes)])
    print(f"{name} (worker {pub.worker_id}) holds {len(hashes)} blocks", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    asyncio.run(main())
