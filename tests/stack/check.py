"""What scripts/test-deploy asks the running stack from the host, as an operator or a router
would: lookups through the published NATS port (msgpack, docs/PROTOCOL.md), and Prometheus'
HTTP API. Each command exits non-zero, saying why, when the answer never comes right.

    check.py lookup NATS_URL --tokens FROM-TO --block-size B --worker W --blocks N [--timeout S]
    check.py prom-up PROM_ADDR JOB [--timeout S]
    check.py prom-growing PROM_ADDR EXPR [--timeout S]
    check.py doc-sample NATS_URL FILE   (runs the Python sample of FILE, compares its reply)
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
        return bool(r) and all(s["value"][1] == "1" for s in r), r

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
    up.add_argument("--timeout", type=float, default=60)
    gr = sub.add_parser("prom-growing")
    gr.add_argument("addr")
    gr.add_argument("expr")
    gr.add_argument("--timeout", type=float, default=60)
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
    else:
        doc_sample(args)


if __name__ == "__main__":
    main()
