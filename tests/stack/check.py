"""What scripts/test-deploy asks the running stack from the host, as an operator or a router
would: lookups through the published NATS port (msgpack, docs/PROTOCOL.md), and Prometheus'
HTTP API. Each command exits non-zero, saying why, when the answer never comes right.

    check.py lookup NATS_URL --tokens FROM-TO --block-size B --worker W --blocks N [--timeout S]
    check.py prom-up PROM_ADDR JOB [--targets N] [--timeout S]
    check.py prom-growing PROM_ADDR EXPR [--timeout S]
    check.py doc-sample NATS_URL FILE   (runs the Python sample of FILE, compares its reply)
    check.py shards NATS_URL --shards S --workers N [--timeout S]
"""
import argparse
import ast
import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.parse
import urllib.request


def fail(why):
    print(f"FAIL: {why}", file=sys.stderr)
    sys.exit(1)


async def lookup(args):
    import msgpack
    import nats

    first, last = (int(x) for x in args.tokens.split("-"))
    req = {"tokens": list(range(first, last + 1)), "block_size": args.block_size, "workers": [args.worker]}
    nc = await nats.connect(args.url)
    deadline = time.monotonic() + args.timeout
    got = None
    while time.monotonic() < deadline:
        try:
            reply = await nc.request(f"{args.prefix}.lookup", msgpack.packb(req), timeout=2)
            got = msgpack.unpackb(reply.data)
            depth = [m["blocks"] for m in got.get("matches", []) if m["worker_id"] == args.worker]
            if depth == [args.blocks]:
                print(f"lookup through {args.url}: worker {args.worker} holds {args.blocks} blocks: {got}")
                await nc.close()
                return
        except Exception as e:  # noqa: BLE001 (no responders yet, a timeout: asked again)
            got = repr(e)
        await asyncio.sleep(0.5)
    await nc.close()
    fail(f"lookup of tokens {args.tokens} through {args.url}: wanted worker {args.worker} at {args.blocks} blocks, last answer {got}")


def partition(worker_id, shards):
    """NATS's partition(S, token): FNV-1a (32 bits) of the worker id's decimal text, mod S."""
    h = 0x811C9DC5
    for b in str(worker_id).encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h % shards


async def shards(args):
    """Workers 1..N each store the same 4 blocks through the sharded NATS server; one lookup,
    published once, is answered by every shard (one reply each, saying which shard of how
    many), each naming its own workers alone, and together every worker at 4 blocks."""
    import msgpack
    import nats

    nc = await nats.connect(args.url)
    workers = list(range(1, args.workers + 1))
    epoch = time.time_ns()
    for w in workers:
        batch = {"worker_id": w, "dp_rank": 0, "epoch": epoch, "ts_ns": time.time_ns(),
                 "events": [{"event_id": 0, "data": {"stored": {"parent_hash": None,
                     "blocks": [{"block_hash": 9000 + i, "tokens_hash": 900 + i} for i in range(4)]}}}]}
        await nc.publish(f"{args.prefix}.events.{w}", msgpack.packb(batch))
    await nc.flush()
    request = msgpack.packb({"block_hashes": [900, 901, 902, 903]})
    deadline = time.monotonic() + args.timeout
    last = None
    while time.monotonic() < deadline:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(f"{args.prefix}.lookup", request, reply=inbox)
        replies = []
        try:
            while len(replies) < args.shards:
                msg = await sub.next_msg(timeout=2)
                replies.append(msgpack.unpackb(msg.data))
        except Exception:  # noqa: BLE001 (a shard not up yet: asked again)
            pass
        await sub.unsubscribe()
        by_shard = {}
        for r in replies:
            of = r.get("shard") or {}
            by_shard[of.get("shard")] = (of.get("shards"), sorted(m["worker_id"] for m in r["matches"] if m["blocks"] == 4))
        want = {k: (args.shards, [w for w in workers if partition(w, args.shards) == k]) for k in range(args.shards)}
        last = by_shard
        if by_shard == want:
            for k, (_, ws) in sorted(by_shard.items()):
                print(f"shard {k} of {args.shards} answers for its own workers alone: {ws}")
            await nc.close()
            return
        await asyncio.sleep(0.5)
    await nc.close()
    fail(f"sharded lookups through {args.url}: wanted {want}, last answered {last}")


def prom(addr, expr):
    url = f"http://{addr}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.load(r)
    if body.get("status") != "success":
        raise RuntimeError(body)
    return body["data"]["result"]


def poll(timeout, what, probe):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            ok, last = probe()
            if ok:
                return last
        except Exception as e:  # noqa: BLE001 (Prometheus still starting)
            last = repr(e)
        time.sleep(1)
    fail(f"{what}: last seen {last}")


def prom_up(args):
    def probe():
        r = prom(args.addr, f'up{{job="{args.job}"}}')
        enough = len(r) == args.targets if args.targets else bool(r)
        return enough and all(s["value"][1] == "1" for s in r), r

    r = poll(args.timeout, f"Prometheus target job={args.job} up", probe)
    print(f"Prometheus scrapes job {args.job}: {len(r)} target(s) up")


def prom_growing(args):
    def value():
        r = prom(args.addr, args.expr)
        return float(r[0]["value"][1]) if r else None

    first = poll(args.timeout, f"{args.expr} has a value", lambda: ((v := value()) is not None, v))
    last = poll(args.timeout, f"{args.expr} grows past {first}", lambda: ((v := value()) is not None and v > first, v))
    print(f"{args.expr}: {first:.0f} -> {last:.0f}")


def doc_sample(args):
    text = open(args.file).read()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    printed = re.search(r"print\(.*\)\s*#\s*(\{.*\})\s*$", code, re.M)
    if not printed:
        fail(f"{args.file}: the sample prints no documented reply")
    want = ast.literal_eval(printed.group(1))
    code = code.replace("nats://127.0.0.1:4222", args.url)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        fail(f"{args.file}'s sample failed: {out.stderr}")
    got = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    if got != want:
        fail(f"{args.file}'s sample printed {got}, the document says {want}")
    print(f"{args.file}'s Python sample prints what it documents: {got}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    lk = sub.add_parser("lookup")
    lk.add_argument("url")
    lk.add_argument("--prefix", default="kv")
    lk.add_argument("--tokens", required=True)
    lk.add_argument("--block-size", type=int, required=True)
    lk.add_argument("--worker", type=int, required=True)
    lk.add_argument("--blocks", type=int, required=True)
    lk.add_argument("--timeout", type=float, default=60)
    up = sub.add_parser("prom-up")
    up.add_argument("addr")
    up.add_argument("job")
    up.add_argument("--targets", type=int, default=0, help="exactly this many targets (0: any)")
    up.add_argument("--timeout", type=float, default=60)
    gr = sub.add_parser("prom-growing")
    gr.add_argument("addr")
    gr.add_argument("expr")
    gr.add_argument("--timeout", type=float, default=60)
    sh = sub.add_parser("shards")
    sh.add_argument("url")
    sh.add_argument("--prefix", default="kv")
    sh.add_argument("--shards", type=int, required=True)
    sh.add_argument("--workers", type=int, required=True)
    sh.add_argument("--timeout", type=float, default=60)
    ds = sub.add_parser("doc-sample")
    ds.add_argument("url")
    ds.add_argument("file")
    args = p.parse_args()
    if args.cmd == "lookup":
        asyncio.run(lookup(args))
    elif args.cmd == "prom-up":
        prom_up(args)
    elif args.cmd == "prom-growing":
        prom_growing(args)
    elif args.cmd == "shards":
        asyncio.run(shards(args))
    else:
        doc_sample(args)


if __name__ == "__main__":
    main()
