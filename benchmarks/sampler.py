"""Decode throughput: our jitted KV-cache sampler against `transformers` `generate`.

Both sides run the same random Qwen2 weights (`--family gemma3`: Gemma 3 text, local and global
layers alternating, a window of 32 tokens of the 160 decoded; `--family qwen3_moe`: Qwen3-MoE, 8 experts
of which each token takes 2, each half the dense MLP, our sampler recording every token's experts as a
run's does): transformers makes the model and saves it,
and our HF bridge loads that directory. Both sample at temperature 1 (no top-k/top-p) in
float32, from the same left-padded prompts, for exactly `new_tokens` tokens (no EOS on
either side). Throughput is generated tokens per second of wall time, each side's best of
2 x `repeats` runs after a warm-up (ours half before the reference, half after); our compile
time is reported on its own. The reference may run under another interpreter
(benchmarks/torch_reference.py): the default tier has no CPU torch here. Run through
`benchmarks.run`, XLA gets the CLI's CPU flags (jaxreplay/tools/xla_cpu.py).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from typing import Callable, Optional

import jax
import numpy as np

from flax import nnx

from benchmarks.torch_reference import best_time, reference
from benchmarks.torch_reference import torch_python as find_torch_python
from jaxreplay.models.hf import load_hf_model
from jaxreplay.models.transformer import Transformer, split
from jaxreplay.rollout.sampling import make_sampler

# The calibration model: 3.1M parameters.
FULL = dict(vocab=512, width=256, layers=4, heads=8, kv_heads=2, d_ff=704, prompt=32, new_tokens=128,
            batches=(1, 16, 64), repeats=2)
QUICK = dict(vocab=128, width=32, layers=1, heads=2, kv_heads=1, d_ff=64, prompt=8, new_tokens=8,
             batches=(1, 4), repeats=1)


def prompts(batch: int, length: int, vocab: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random left-padded prompts [batch, length]: half the rows lose their first quarter."""
    tokens = rng.integers(1, vocab, (batch, length)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[: batch // 2, : length // 4] = False
    tokens[~mask] = 0
    return tokens, mask


def compiled_sampler(sample, params, tokens: np.ndarray, mask: np.ndarray) -> tuple[float, Callable[[], object]]:
    """(compile seconds, a warmed-up thunk that decodes once and waits for the tokens)."""
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = sample.lower(params, tokens, mask, key).compile()
    compile_s = time.perf_counter() - t0
    decode = lambda: jax.block_until_ready(compiled(params, tokens, mask, key).tokens)
    decode()
    return compile_s, decode


def run(quick: bool = False, torch_python: Optional[str] = None, family: str = "qwen2",
        moe_dispatch: Optional[str] = None) -> list[dict]:
    """One row per batch size: tokens/s of both sides, their ratio, and our compile seconds.

    The reference runs under `torch_python` (default: this interpreter if it has torch, else
    the Reverb lane's venv); ours is timed before and after it, so neither side is favoured
    by running first. `moe_dispatch` (qwen3_moe): the experts' dispatch, else the model's default.
    """
    python = find_torch_python(torch_python)
    if python is None:
        raise RuntimeError("no interpreter with torch and transformers for the generate reference: install the "
                           "'parity' extra, or pass --torch-python PATH (e.g. .venv-reverb/bin/python)")
    s = dict(QUICK if quick else FULL, family=family, window=4 if quick else 32, experts=4 if quick else 8)
    ref = reference(python)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ref.write_model(tmp, s)
            cfg, graphdef, params = load_hf_model(tmp, max_seq_len=s["prompt"] + s["new_tokens"])
            if moe_dispatch is not None:  # the same parameters, dispatched another way
                cfg = dataclasses.replace(cfg, moe_dispatch=moe_dispatch)
                graphdef, _ = split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0))))
            # No stop ids: every row emits exactly new_tokens tokens, as generate does.
            sample = make_sampler(graphdef, cfg, max_new_tokens=s["new_tokens"], temperature=1.0, stop_ids=(),
                                  pad_id=0)
            rng = np.random.default_rng(0)
            for batch in s["batches"]:
                tokens, mask = prompts(batch, s["prompt"], s["vocab"], rng)
                compile_s, ours = compiled_sampler(sample, params, tokens, mask)
                # Each side's best of 2 x repeats runs: ours half before the reference, half after.
                ours_s = best_time(ours, s["repeats"])
                theirs = ref.time_generate(tmp, tokens, mask, s["new_tokens"], 2 * s["repeats"])
                ours_s = min(ours_s, best_time(ours, s["repeats"]))
                n = batch * s["new_tokens"]
                rows.append({"batch": batch, "ours_tok_s": n / ours_s, "generate_tok_s": n / theirs["seconds"],
                             "ratio": theirs["seconds"] / ours_s, "compile_s": compile_s,
                             "torch_threads": theirs["threads"], "torch": theirs["torch"],
                             "torch_python": theirs["python"]})
    finally:
        ref.close()
    return rows


def main(argv=None) -> None:
    """`python -m benchmarks.sampler [--runs N] [--torch-python PATH] [--family gemma3|qwen3_moe]
    [--moe-dispatch dense]`: only this benchmark, N times (each side by side), then each batch's median
    ratio: one run on a shared machine is noise."""
    import argparse
    import statistics

    from jaxreplay.tools.xla_cpu import tune_cpu_compiler

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--torch-python", help="interpreter with torch + transformers (as benchmarks.run)")
    parser.add_argument("--family", choices=("qwen2", "gemma3", "qwen3_moe"), default="qwen2",
                        help="the random model's family")
    parser.add_argument("--moe-dispatch", choices=("ragged_dot", "dense"), help="qwen3_moe: the experts' dispatch")
    args = parser.parse_args(argv)
    tune_cpu_compiler()  # as benchmarks.run and the CLI do
    runs = []
    for k in range(args.runs):
        runs.append(run(torch_python=args.torch_python, family=args.family, moe_dispatch=args.moe_dispatch))
        print(f"run {k + 1}:", ", ".join(f"batch {r['batch']} {r['ratio']:.2f}x ({r['ours_tok_s']:.0f} / "
                                          f"{r['generate_tok_s']:.0f} tok/s)" for r in runs[-1]), flush=True)
    for i, row in enumerate(runs[0]):
        print(f"batch {row['batch']}: median {statistics.median(r[i]['ratio'] for r in runs):.2f}x")


if __name__ == "__main__":
    main()
