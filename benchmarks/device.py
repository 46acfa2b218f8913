"""The accelerator benchmark (one GPU or a TPU VM; `benchmarks/device.sh` installs and runs it).

    python -m benchmarks.device --out DIR [--quick]

With random weights of a Qwen2.5-0.5B-shaped model in bfloat16 it measures:
  - decode tokens/s of our sampler at batch 64 and 256 (128 prompt + 128 new tokens), and
    the fraction of the HBM-bandwidth roofline reached: every decode step must read the
    weights once plus each row's whole KV cache, so tokens/s <= B * bandwidth / bytes per step;
  - `transformers` `generate` on the same weights and the same device (torch, CUDA) at batch 64,
    when torch sees a GPU: the side-by-side reference;
  - train-step MFU: 6 * params * tokens per second (plus attention) over the chip's peak.
Writes DIR/device.json. `--quick` runs a tiny model on whatever JAX finds (CPU included):
the dry run tests/test_benchmarks.py does, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.learner import random_batch
from benchmarks.sampler import best_time, compiled_sampler, generate_fn, prompts, write_qwen2
from jaxreplay.config import Config
from jaxreplay.learner import make_optimizer, make_train_step, to_device_batch
from jaxreplay.models import count_params
from jaxreplay.models.hf import load_hf_model
from jaxreplay.sampling import make_sampler

# Qwen2.5-0.5B's shape (494M parameters, tied embeddings).
FULL = dict(vocab=151_936, width=896, layers=24, heads=14, kv_heads=2, d_ff=4864, prompt=128, new_tokens=128,
            batches=(64, 256), generate_batch=64, train_batch=16, train_len=1024, repeats=3)
QUICK = dict(vocab=128, width=32, layers=1, heads=2, kv_heads=1, d_ff=64, prompt=8, new_tokens=8,
             batches=(2, 4), generate_batch=2, train_batch=2, train_len=16, repeats=1)

# Peak dense bf16 FLOP/s and HBM bytes/s per chip, by jax `device_kind`; override with flags.
CHIPS = {"NVIDIA H200": (989e12, 4.8e12), "NVIDIA H100 80GB HBM3": (989e12, 3.35e12),
         "TPU v5 lite": (197e12, 0.82e12), "TPU v4": (275e12, 1.2e12), "TPU v5p": (459e12, 2.77e12)}


def decode_bytes_per_step(params_bytes: int, s: dict, batch: int, head_dim: int) -> float:
    """HBM bytes one decode step must read: all weights, and K and V of every cache slot
    (our sampler attends over the whole [prompt + new] cache each step), bf16."""
    cache = 2 * s["layers"] * batch * (s["prompt"] + s["new_tokens"]) * s["kv_heads"] * head_dim * 2
    return params_bytes + cache


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for device.json")
    parser.add_argument("--quick", action="store_true", help="tiny model, any backend: a dry run")
    parser.add_argument("--peak-tflops", type=float, help="chip peak bf16 TFLOP/s (default: by device kind)")
    parser.add_argument("--hbm-gbps", type=float, help="chip HBM GB/s (default: by device kind)")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    device = jax.devices()[0]
    peak, bandwidth = CHIPS.get(device.device_kind, (None, None))
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak
    bandwidth = args.hbm_gbps * 1e9 if args.hbm_gbps else bandwidth
    results = {"device": device.device_kind, "platform": device.platform, "quick": args.quick,
               "peak_flops": peak, "hbm_bytes_s": bandwidth, "decode": []}
    start = time.perf_counter()

    with tempfile.TemporaryDirectory() as tmp:
        write_qwen2(Path(tmp), s, dtype="bfloat16")
        cfg, graphdef, params = load_hf_model(tmp, param_dtype="bfloat16", compute_dtype="bfloat16",
                                              max_seq_len=max(s["prompt"] + s["new_tokens"], s["train_len"]))
        hf = hf_model(tmp)
    n_params = count_params(params)
    results["params"] = n_params
    sample = make_sampler(graphdef, cfg, max_new_tokens=s["new_tokens"], temperature=1.0, stop_ids=(), pad_id=0)
    rng = np.random.default_rng(0)
    for batch in s["batches"]:
        tokens, mask = prompts(batch, s["prompt"], s["vocab"], rng)
        compile_s, decode = compiled_sampler(sample, params, tokens, mask)
        row = {"batch": batch, "compile_s": compile_s}
        seconds = best_time(decode, s["repeats"])
        row["ours_tok_s"] = batch * s["new_tokens"] / seconds
        if bandwidth:
            per_step = decode_bytes_per_step(2 * n_params, s, batch, cfg.head_dim)
            row["roofline_fraction"] = row["ours_tok_s"] / (batch * bandwidth / per_step)
        if hf is not None and batch == s["generate_batch"]:
            generate = generate_fn(hf, tokens, mask, s["new_tokens"], device=str(hf.device))
            generate()  # warm-up
            row["generate_tok_s"] = batch * s["new_tokens"] / best_time(generate, s["repeats"])
            row["ratio"] = row["ours_tok_s"] / row["generate_tok_s"]
        results["decode"].append(row)
        print(row, flush=True)
    del hf

    config = Config(model=cfg)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=s["train_batch"]))
    optimizer = make_optimizer(config.train)
    opt_state = optimizer.init(params)
    step = make_train_step(graphdef, config, optimizer)
    host = random_batch(config, s["train_batch"], s["train_len"], rng)
    batch = to_device_batch(host)
    params, opt_state, metrics = step(params, opt_state, batch, None)
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(s["repeats"]):
        params, opt_state, metrics = step(params, opt_state, batch, None)
    jax.block_until_ready((params, metrics))
    step_s = (time.perf_counter() - t0) / s["repeats"]
    tokens = s["train_batch"] * s["train_len"]
    # Forward + backward: 6 FLOPs per parameter per token, plus attention's 12 * L * T * width per token.
    flops = tokens * (6 * n_params + 12 * s["layers"] * s["train_len"] * s["heads"] * cfg.head_dim)
    results["train"] = {"batch": s["train_batch"], "length": s["train_len"], "step_s": step_s,
                        "tokens_s": tokens / step_s, "mfu": flops / step_s / peak if peak else None}
    print(results["train"], flush=True)
    results["seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "device.json").write_text(json.dumps(results, indent=1))
    return results


def hf_model(path: str):
    """`transformers`' model on the first CUDA device (CPU in a dry run), or None without torch."""
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if torch.cuda.is_available():
        where = "cuda"
    elif jax.default_backend() == "cpu":  # the dry run
        where = "cpu"
    else:  # a TPU VM: torch has no device there to compare on
        return None
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(where).eval()


if __name__ == "__main__":
    main()
