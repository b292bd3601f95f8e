"""A stand-in engine for the deployment test: publishes KV events the way vLLM does on ZMQ
(PUB: [topic, seq as 8 bytes big-endian, msgpack batch]; a ROUTER that replays its buffer from
a sequence number, then sends seq -1), so that `kvindex bridge` in the compose stack has an
engine to subscribe to.

Its first batch (seq 0) stores one chain of four 16-token blocks (token ids 1..64, block
hashes 1001..1004); every later batch, one a second, is empty. A bridge that connects late
sees seq > 0 first and asks the ROUTER for the batches from 0: the chain arrives by replay.
"""
import struct
import time

import msgpack
import zmq

ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.bind("tcp://*:5557")
router = ctx.socket(zmq.ROUTER)
router.bind("tcp://*:5558")

stored = {"type": "BlockStored", "block_hashes": [1001, 1002, 1003, 1004], "parent_block_hash": None,
          "token_ids": list(range(1, 65)), "block_size": 16, "lora_id": None, "medium": "GPU"}
buffer = []
seq = 0
poller = zmq.Poller()
poller.register(router, zmq.POLLIN)
next_batch = time.monotonic()
print("engine: PUB on 5557, replay ROUTER on 5558", flush=True)
while True:
    now = time.monotonic()
    if now >= next_batch:
        payload = msgpack.packb([time.time(), [stored] if seq == 0 else [], 0])
        buffer.append((seq, payload))
        pub.send_multipart([b"kv-events", struct.pack(">q", seq), payload])
        seq += 1
        next_batch = now + 1.0
    if dict(poller.poll(max(0, int((next_batch - now) * 1000)))).get(router):
        frames = router.recv_multipart()
        start = struct.unpack(">q", frames[-1])[0]
        print(f"engine: replay from {start} asked", flush=True)
        for q, p in buffer:
            if q >= start:
                router.send_multipart([frames[0], b"", struct.pack(">q", q), p])
        router.send_multipart([frames[0], b"", struct.pack(">q", -1), b""])
