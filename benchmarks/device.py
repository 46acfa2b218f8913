"""The accelerator benchmark, on the JAX this Python already has (`benchmarks/device.sh` runs it).

    python -m benchmarks.device --out DIR [--quick]

GPU images ship a current JAX with CUDA (and flax, optax, transformers, torch) and often no
network, so nothing is installed or downloaded: the weights are random, made here. With a
Qwen2.5-0.5B-shaped model in bfloat16 it measures:
  - decode tokens/s of our sampler at batch 64 and 256 (128 prompt + 128 new tokens), and
    the fraction of the HBM-bandwidth roofline reached: every decode step must read the
    weights once plus each row's whole KV cache, so tokens/s <= B * bandwidth / bytes per step;
  - `transformers` `generate` on the same weights and the same device (torch, CUDA) at batch 64,
    when torch sees a GPU: the side-by-side reference;
  - train-step MFU: 6 * params * tokens per second (plus attention) over the chip's peak.
Writes DIR/device.json after each part (a run stopped by a time limit keeps what it measured).
A full run needs jax >= 0.8 and an accelerator. `--quick` runs a tiny model on whatever JAX
finds (CPU included): the dry run tests/test_device_benchmark.py does; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from benchmarks.learner import random_batch
from benchmarks.sampler import compiled_sampler, prompts
from benchmarks.torch_reference import best_time, generate_fn
from jaxreplay.config import Config, ModelConfig
from jaxreplay.learn.learner import make_optimizer, make_train_step
from jaxreplay.models.transformer import count_params, init_params
from jaxreplay.rollout.rollouts import to_device_batch
from jaxreplay.rollout.sampling import make_sampler

# Qwen2.5-0.5B's shape (494,032,768 parameters, tied embeddings, q/k/v biases).
FULL = dict(vocab=151_936, width=896, layers=24, heads=14, kv_heads=2, head_dim=64, d_ff=4864, prompt=128,
            new_tokens=128, batches=(64, 256), generate_batch=64, train_batch=16, train_len=1024, repeats=3)
QUICK = dict(vocab=128, width=32, layers=1, heads=2, kv_heads=1, head_dim=16, d_ff=64, prompt=8, new_tokens=8,
             batches=(2, 4), generate_batch=2, train_batch=2, train_len=16, repeats=1)
MIN_JAX = (0, 8)  # the default tier's floor

# Peak dense bf16 FLOP/s and HBM bytes/s per chip, by jax `device_kind`; override with flags.
CHIPS = {"NVIDIA H200": (989e12, 4.8e12), "NVIDIA H100 80GB HBM3": (989e12, 3.35e12),
         "TPU v5 lite": (197e12, 0.82e12), "TPU v4": (275e12, 1.2e12), "TPU v5p": (459e12, 2.77e12),
         "TPU v6 lite": (918e12, 1.64e12)}


class DeviceError(Exception):
    """This machine cannot run the benchmark as asked: one line, exit code 2."""


def model_config(s: dict) -> ModelConfig:
    return ModelConfig(vocab_size=s["vocab"], d_model=s["width"], n_layers=s["layers"], n_heads=s["heads"],
                       n_kv_heads=s["kv_heads"], head_dim=s["head_dim"], d_ff=s["d_ff"],
                       max_seq_len=max(s["prompt"] + s["new_tokens"], s["train_len"]), rope_theta=1e6,
                       tie_embeddings=True, attention_bias=True, param_dtype="bfloat16", compute_dtype="bfloat16")


def decode_bytes_per_step(params_bytes: int, s: dict, batch: int) -> float:
    """HBM bytes one decode step must read: all weights, and K and V of every cache slot
    (our sampler attends over the whole [prompt + new] cache each step), bf16."""
    cache = 2 * s["layers"] * batch * (s["prompt"] + s["new_tokens"]) * s["kv_heads"] * s["head_dim"] * 2
    return params_bytes + cache


def check_machine(quick: bool) -> None:
    """A full run needs a current JAX on an accelerator; nothing is installed to get one."""
    version = tuple(int(part) for part in jax.__version__.split(".")[:2])
    if not quick and version < MIN_JAX:
        raise DeviceError(f"jax {jax.__version__} is older than {'.'.join(map(str, MIN_JAX))}: the benchmark "
                          "runs on the JAX it finds and installs none")
    if not quick and jax.default_backend() == "cpu":
        raise DeviceError("JAX sees no accelerator (only cpu): --quick runs the tiny dry run on CPU")


def versions() -> dict:
    """Python's and the installed distributions' versions: what this run measured."""
    found = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "transformers", "torch"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def hf_reference(cfg: ModelConfig, params, directory: Path):
    """`transformers`' model with the same weights on the first CUDA device (CPU in a dry run),
    or the reason there is none."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
        return None, "torch or transformers is not installed"
    import torch
    import transformers

    from jaxreplay.models.hf import save_hf_model

    if torch.cuda.is_available():
        where = "cuda"
    elif jax.default_backend() == "cpu":  # the dry run
        where = "cpu"
    else:  # a TPU VM: torch has no device there to compare on
        return None, f"torch sees no device beside JAX's {jax.default_backend()}"
    save_hf_model(directory, cfg, params)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.bfloat16)
    return model.to(where).eval(), None


def decode(results: dict, cfg: ModelConfig, graphdef, params, s: dict, hf, bandwidth, out: Path) -> None:
    sample = make_sampler(graphdef, cfg, max_new_tokens=s["new_tokens"], temperature=1.0, stop_ids=(), pad_id=0)
    rng = np.random.default_rng(0)
    for batch in s["batches"]:
        tokens, mask = prompts(batch, s["prompt"], s["vocab"], rng)
        compile_s, ours = compiled_sampler(sample, params, tokens, mask)
        row = {"batch": batch, "compile_s": compile_s}
        row["ours_tok_s"] = batch * s["new_tokens"] / best_time(ours, s["repeats"])
        if bandwidth:
            per_step = decode_bytes_per_step(2 * results["params"], s, batch)
            row["roofline_fraction"] = row["ours_tok_s"] / (batch * bandwidth / per_step)
        if hf is not None and batch == s["generate_batch"]:
            generate = generate_fn(hf, tokens, mask, s["new_tokens"], device=str(hf.device))
            generate()  # warm-up
            row["generate_tok_s"] = batch * s["new_tokens"] / best_time(generate, s["repeats"])
            row["ratio"] = row["ours_tok_s"] / row["generate_tok_s"]
        results["decode"].append(row)
        _write(out, results)
        print(row, flush=True)


def train_step(results: dict, cfg: ModelConfig, graphdef, params, s: dict, peak) -> None:
    config = Config(model=cfg)
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, batch_size=s["train_batch"]))
    optimizer = make_optimizer(config.train)
    opt_state = optimizer.init(params)
    step = make_train_step(graphdef, config, optimizer)
    batch = to_device_batch(random_batch(config, s["train_batch"], s["train_len"], np.random.default_rng(1)))
    t0 = time.perf_counter()
    params, opt_state, metrics = step(params, opt_state, batch, None)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(s["repeats"]):
        params, opt_state, metrics = step(params, opt_state, batch, None)
    jax.block_until_ready((params, metrics))
    step_s = (time.perf_counter() - t0) / s["repeats"]
    tokens = s["train_batch"] * s["train_len"]
    # Forward + backward: 6 FLOPs per parameter per token, plus attention's 12 * L * T * width per token.
    flops = tokens * (6 * results["params"] + 12 * s["layers"] * s["train_len"] * s["heads"] * s["head_dim"])
    results["train"] = {"batch": s["train_batch"], "length": s["train_len"], "compile_s": compile_s,
                        "step_s": step_s, "tokens_s": tokens / step_s, "mfu": flops / step_s / peak if peak else None}
    print(results["train"], flush=True)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for device.json")
    parser.add_argument("--quick", action="store_true", help="tiny model, any backend: a dry run")
    parser.add_argument("--peak-tflops", type=float, help="chip peak bf16 TFLOP/s (default: by device kind)")
    parser.add_argument("--hbm-gbps", type=float, help="chip HBM GB/s (default: by device kind)")
    args = parser.parse_args(argv)
    check_machine(args.quick)
    s = QUICK if args.quick else FULL
    out = Path(args.out)
    device = jax.devices()[0]
    peak, bandwidth = CHIPS.get(device.device_kind, (None, None))
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak
    bandwidth = args.hbm_gbps * 1e9 if args.hbm_gbps else bandwidth
    start = time.perf_counter()
    results = {"device": device.device_kind, "platform": device.platform, "quick": args.quick,
               "versions": versions(), "peak_flops": peak, "hbm_bytes_s": bandwidth, "decode": []}

    cfg = model_config(s)
    graphdef, params = init_params(cfg, 0)
    results["params"] = count_params(params)
    with tempfile.TemporaryDirectory() as tmp:
        hf, results["generate_skipped"] = hf_reference(cfg, params, Path(tmp))
    results["setup_s"] = time.perf_counter() - start
    _write(out, results)
    decode(results, cfg, graphdef, params, s, hf, bandwidth, out)
    del hf
    train_step(results, cfg, graphdef, params, s, peak)
    results["seconds"] = time.perf_counter() - start
    _write(out, results)
    return results


def _write(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "device.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    try:
        main()
    except DeviceError as e:
        print(f"device: {e}", file=sys.stderr)
        sys.exit(2)
