"""Client overhead of generation: requests/s of the full client vs a bare aiohttp loop, same concurrency.

Both run against the SGLang stand-in with its instant engine (DFLASH_TEST_SERVER_ENGINE=instant) (it answers at once), so the
numbers measure what the client costs per request: the bare loop only posts the chat request and parses the
JSON; the client also plans turns, applies the retry/length/empty policy, load-spreads, journals every sample
(batched fsync) and writes the final shard. Ratio = client / bare (1.0 = no overhead).

    .venv/bin/python benchmarks/generation_client_overhead.py [--samples 2000] [--concurrency 16 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from generation_helpers import SERVER, free_port, knob_env, wait_health, write_shard  # noqa: E402


async def bare_loop(url: str, messages: list[list[dict]], concurrency: int) -> float:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(msgs):
            async with sem:
                async with session.post(url + "/v1/chat/completions", json={
                        "messages": msgs, "max_tokens": 64, "temperature": 0.6,
                        "chat_template_kwargs": {"enable_thinking": True}}) as resp:
                    data = await resp.json()
                    assert data["choices"][0]["message"]["content"]

        t0 = time.perf_counter()
        await asyncio.gather(*(one(m) for m in messages))
        return time.perf_counter() - t0


def client_run(url: str, shard: Path, out: Path, concurrency: int) -> float:
    from dflash_pipeline.generation import stage as generate

    parser = argparse.ArgumentParser()
    generate.add_arguments(parser)
    args = parser.parse_args(["--input", str(shard), "--out", str(out), "--backend", "servers", "--servers", url,
                              "--max-in-flight", str(concurrency), "--max-new-tokens", "64",
                              "--progress-interval", "3600"])
    jobs = [generate.ShardJob(str(shard), str(out), out.parent / "journal" / "bench.jsonl", None)]
    t0 = time.perf_counter()
    asyncio.run(generate._amain(jobs, args, None))
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        rows = write_shard(tmp / "in.parquet", args.samples, seed=0, placeholder_rate=0.0)
        first_turns = []
        for r in rows:  # what the client sends for turns=first: up to the first assistant turn
            msgs = []
            for m in r["messages"]:
                if m["role"] == "assistant":
                    break
                msgs.append({"role": m["role"], "content": m["content"]})
            first_turns.append(msgs)
        port = free_port()
        server = subprocess.Popen([sys.executable, str(SERVER), "--model-path", "none", "--port", str(port),
                                   "--reasoning-parser", "qwen3"], env={**os.environ, **knob_env(engine="instant")},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_health(url)
            asyncio.run(bare_loop(url, first_turns[:200], 16))  # warm-up
            print(f"{len(rows)} requests per run, server answers at once (instant engine), best of {args.repeats}")
            print(f"| concurrency | bare aiohttp loop (req/s) | pipeline client (req/s) | ratio client/bare |")
            print(f"|---:|---:|---:|---:|")
            for c in args.concurrency:
                bares, clients = [], []
                for i in range(args.repeats):  # interleaved, so that load from elsewhere hits both alike
                    bares.append(asyncio.run(bare_loop(url, first_turns, c)))
                    clients.append(client_run(url, tmp / "in.parquet", tmp / f"run{c}-{i}" / "bench.parquet", c))
                bare, client = min(bares), min(clients)
                print(f"| {c} | {len(rows) / bare:,.0f} | {len(rows) / client:,.0f} | {bare / client:.2f} |",
                      flush=True)
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
