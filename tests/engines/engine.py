"""An engine's own KV-event publisher, driven by a test.

Loads the `kv_events` module of vLLM or SGLang from their wheels (unpacked by
scripts/fetch-engines; only the imports unrelated to publishing are stubbed), starts its
`ZmqEventPublisher` (PUB socket, replay ROUTER, replay buffer) and publishes what the test
asks for, as the engine's scheduler would: its own event classes, batches and encoder.

    engine.py vllm|sglang SRC ENDPOINT [REPLAY_ENDPOINT|-] [BUFFER_STEPS] [DP_RANK]

One JSON command per line on stdin; each is answered with one line on stdout:
    {"events": [{"type": "BlockStored", ...}, ...]}  -> "sent SEQ" once on the socket
    {"events": [], "burst": N}  -> N batches at once, batch i storing a root block of hash
                                   100000 + i (tokens 100000 + 4i ...) and removing the last
    {"quit": true}                                   -> "bye"
A block hash given as "hex:..." is sent as bytes (vLLM's digest hashes).
"""

import importlib.util
import ipaddress
import json
import logging
import os
import sys
import time
import types


def stub(name, **attrs):
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_vllm(src):
    for package in ["vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"]:
        stub(package)
    stub("vllm.config.kv_events", KVEventsConfig=type("KVEventsConfig", (), {"__init__": lambda self, **kw: None}))
    stub("vllm.logger", init_logger=logging.getLogger)

    def is_ipv6(ip):
        try:
            return isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address)
        except ValueError:
            return False

    stub(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=is_ipv6,
        split_zmq_path=lambda p: tuple(p.rsplit(":", 2)),
    )
    stub("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return load("vllm.distributed.kv_events", os.path.join(src, "vllm/distributed/kv_events.py"))


def load_sglang(src):
    for package in ["sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation"]:
        stub(package)
    if importlib.util.find_spec("pydantic") is None:
        stub("pydantic", BaseModel=object)
    stub("sglang.srt.runtime_context", get_parallel=lambda: None)
    stub("sglang.srt.utils.network", NetworkAddress=None)
    return load("sglang.srt.disaggregation.kv_events", os.path.join(src, "sglang/srt/disaggregation/kv_events.py"))


def hashes(values):
    return [bytes.fromhex(v[4:]) if isinstance(v, str) and v.startswith("hex:") else v for v in values]


def event(module, spec):
    """The engine's event class, built from the test's fields (missing ones left at None)."""
    cls = getattr(module, spec.pop("type"))
    for key in ("block_hashes",):
        if key in spec:
            spec[key] = hashes(spec[key])
    if isinstance(spec.get("parent_block_hash"), str):
        spec["parent_block_hash"] = hashes([spec["parent_block_hash"]])[0]
    defaults = dict(zip(cls.__struct_fields__[-len(cls.__struct_defaults__):], cls.__struct_defaults__)) if cls.__struct_defaults__ else {}
    for field in cls.__struct_fields__:
        if field not in spec and field not in defaults:
            spec[field] = None
    return cls(**spec)


def main():
    engine, src, endpoint = sys.argv[1:4]
    replay = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
    buffer_steps = int(sys.argv[5]) if len(sys.argv) > 5 else 10_000
    rank = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    module = load_vllm(src) if engine == "vllm" else load_sglang(src)
    publisher = module.ZmqEventPublisher(
        rank, endpoint=endpoint, replay_endpoint=replay, buffer_steps=buffer_steps, topic="kv-events"
    )
    print("ready", flush=True)
    seq = 0
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("quit"):
            break
        for i in range(command.get("burst", 0)):
            events = [event(module, {"type": "BlockStored", "block_hashes": [100_000 + i], "parent_block_hash": None,
                                     "token_ids": list(range(100_000 + 4 * i, 100_004 + 4 * i)), "block_size": 4})]
            if i > 0:
                events.append(event(module, {"type": "BlockRemoved", "block_hashes": [100_000 + i - 1]}))
            publisher.publish(module.KVEventBatch(ts=time.time(), events=events))
            seq += 1
        batch = module.KVEventBatch(ts=time.time(), events=[event(module, e) for e in command["events"]])
        publisher.publish(batch)
        # The publisher thread marks each batch done once it is on the PUB socket.
        publisher._event_queue.join()
        print(f"sent {seq}", flush=True)
        seq += 1
    publisher.shutdown()
    print("bye", flush=True)


if __name__ == "__main__":
    main()
