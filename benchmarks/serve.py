"""What the HTTP layer of `jaxreplay serve` costs: tokens/s of S concurrent streams through HTTP
against the same engine thread called in process, on the same requests (same seeds, so the
same tokens).

    .venv/bin/python -m benchmarks.serve [--streams 1,16,64] [--requests 4] [--max-tokens 64] [--repeats 3]

Each of S streams sends `--requests` completions one after another (token-id prompts, streamed
as server-sent events through the official `openai` client's async API); in process, each stream
submits the same `Generation`s to an `EngineWorker` and waits on them. Both sides use a fresh
tiny Qwen2-shaped model (2 layers, d_model 128) with 64 slots; two unmeasured rounds of each
workload compile first.
Median of `--repeats` runs each, side by side, with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN, SLOTS = 32, 64


def write_model(path: Path, max_tokens: int) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_hf import write_char_tokenizer

    from jaxreplay.config import ModelConfig
    from jaxreplay.models.hf import save_hf_model
    from jaxreplay.models.transformer import init_params

    cfg = ModelConfig(vocab_size=128, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384,
                      max_seq_len=PROMPT_LEN + max_tokens, attention_bias=True)
    save_hf_model(path, cfg, init_params(cfg, 0)[1])
    write_char_tokenizer(path)
    (path.parent / "dev.jsonl").write_text(json.dumps({"q": "1", "a": "1"}) + "\n")


def requests(streams: int, per_stream: int) -> list[list[tuple[list[int], int]]]:
    """(prompt ids, seed) of each stream's requests: 16-id prompts of printable characters."""
    return [[([5 + (s * 7 + r * 13 + k) % 90 for k in range(16)], 1000 * s + r) for r in range(per_stream)]
            for s in range(streams)]


def in_process(worker, work, max_tokens: int) -> int:
    from jaxreplay.serve.worker import Draw, Generation

    def one(prompt, seed):
        done = threading.Event()
        gen = Generation(prompt=prompt, n=1, draw=Draw.of(1.0, 0, 1.0), max_tokens=max_tokens, seed=seed,
                         notify=lambda i, c: done.set() if c.finish_reason else None)
        worker.submit(gen)
        done.wait(600)
        return len(gen.choices[0].tokens)

    counts = []

    def stream(items):
        counts.extend(one(p, s) for p, s in items)

    threads = [threading.Thread(target=stream, args=(items,)) for items in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


async def over_http(url: str, work, max_tokens: int) -> int:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

    async def stream(items):
        total = 0
        for prompt, seed in items:
            parts = await client.completions.create(model="bench", prompt=prompt, max_tokens=max_tokens, seed=seed,
                                                    temperature=1.0, stream=True,
                                                    extra_body={"return_token_ids": True})
            async for part in parts:
                total += sum(len(c.model_extra.get("token_ids") or []) for c in part.choices)
        return total

    totals = await asyncio.gather(*(stream(items) for items in work))
    await client.close()
    return sum(totals)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", default="1,16,64")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    streams = [int(s) for s in args.streams.split(",")]
    from jaxreplay.models.hf import load_hf_model
    from jaxreplay.models.tokenizer import load_tokenizer
    from jaxreplay.serve.run import make_worker

    tmp = Path(tempfile.mkdtemp())
    model = tmp / "hf"
    write_model(model, args.max_tokens)
    cfg, graphdef, params = load_hf_model(model)
    worker = make_worker(graphdef, cfg, params, load_tokenizer(model), slots=SLOTS, prompt_len=PROMPT_LEN,
                         max_tokens=args.max_tokens)
    worker.start()
    server = subprocess.Popen(
        [sys.executable, "-m", "jaxreplay", "serve", str(ROOT / "configs" / "demo.yaml"), "task.name=jsonl",
         f"task.path={tmp}/{{split}}.jsonl", "task.prompt_field=q", "task.answer_field=a",
         f"task.max_prompt_len={PROMPT_LEN}", "warmstart.steps=0", f"sampling.max_new_tokens={args.max_tokens}",
         f"model.max_seq_len={PROMPT_LEN + args.max_tokens}", "--hf", str(model), "--port", "0",
         "--slots", str(SLOTS), "--model-name", "bench"], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    url = None
    for line in server.stdout:
        if line.startswith("serving bench on "):
            url = line.split(" on ")[1].split()[0]
            break
    rows = []
    try:
        warm = requests(max(streams), 1)
        in_process(worker, warm, args.max_tokens)
        asyncio.run(over_http(url, warm, args.max_tokens))
        for s in streams:
            work = requests(s, args.requests)
            runs = {"in_process": [], "http": []}
            # Unmeasured first: the engine compiles a program per new shape (groups started at once,
            # window width, drain width), seconds each on CPU, in each process.
            for _ in range(2):
                in_process(worker, work, args.max_tokens)
                asyncio.run(over_http(url, work, args.max_tokens))
            for _ in range(args.repeats):
                for side in runs:
                    t0 = time.perf_counter()
                    tokens = in_process(worker, work, args.max_tokens) if side == "in_process" else \
                        asyncio.run(over_http(url, work, args.max_tokens))
                    runs[side].append(tokens / (time.perf_counter() - t0))
            median = {side: sorted(v)[len(v) // 2] for side, v in runs.items()}
            rows.append({"streams": s, "in_process_tok_s": median["in_process"], "http_tok_s": median["http"],
                         "http_cost": 1 - median["http"] / median["in_process"], "load": os.getloadavg()[0]})
            print(f"streams {s:3d}: in process {median['in_process']:8.0f} tok/s, HTTP {median['http']:8.0f} "
                  f"tok/s, HTTP costs {rows[-1]['http_cost']:+.1%} (load {rows[-1]['load']:.1f})", flush=True)
    finally:
        server.terminate()
        server.wait(60)
        worker.close(0, 30)
    return {"rows": rows}


if __name__ == "__main__":
    main()
