"""A router's lookups over stdin, for routers in other processes (the demo's Python fleet):
``ask.py NATS_URL PREFIX``, then one JSON line per request, ``{"block_hashes": [...],
"workers": [...]}``, answered with one JSON line, ``{"worker_id": blocks, ...}`` (the
up-to-date workers that hold a prefix, shards merged), or ``null`` when kvindex did not answer.
"""

import asyncio
import json
import sys

import nats

from kvindex_client import KvindexError, LookupClient


async def main() -> None:
    url, prefix = sys.argv[1:3]
    nc = await nats.connect(url)
    lookups = LookupClient(nc, prefix, timeout=2.0)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 24)  # a long prompt's hashes fit one line
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    print("ready", flush=True)
    while line := await reader.readline():
        ask = json.loads(line)
        try:
            answer = await lookups.lookup(block_hashes=ask["block_hashes"], workers=ask["workers"])
            depths = {str(m.worker_id): m.blocks for m in answer.matches if not m.stale}
        except KvindexError:
            depths = None
        sys.stdout.write(json.dumps(depths) + "\n")
        sys.stdout.flush()
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
