"""Decode throughput: our jitted KV-cache sampler against `transformers` `generate`.

Both sides run the same random Qwen2 weights: transformers makes the model and saves it,
and our HF bridge loads that directory. Both sample at temperature 1 (no top-k/top-p) in
float32, from the same left-padded prompts, for exactly `new_tokens` tokens (no EOS on
either side). Throughput is generated tokens per second of wall time, best of `repeats`
runs after a warm-up (ours also timed again after the reference); our compile time is
reported on its own. Run through `benchmarks.run`, XLA gets the CLI's CPU flags
(jaxreplay/xla_cpu.py).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxreplay.models.hf import load_hf_model
from jaxreplay.sampling import make_sampler

# The calibration model: 3.1M parameters.
FULL = dict(vocab=512, width=256, layers=4, heads=8, kv_heads=2, d_ff=704, prompt=32, new_tokens=128,
            batches=(1, 16, 64), repeats=2)
QUICK = dict(vocab=128, width=32, layers=1, heads=2, kv_heads=1, d_ff=64, prompt=8, new_tokens=8,
             batches=(1, 4), repeats=1)


def write_qwen2(path: Path, s: dict, dtype: str = "float32") -> None:
    """A random Qwen2 model directory written by transformers itself."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=s["vocab"], hidden_size=s["width"], intermediate_size=s["d_ff"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=4096,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype)).save_pretrained(str(path))


def prompts(batch: int, length: int, vocab: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Random left-padded prompts [batch, length]: half the rows lose their first quarter."""
    tokens = rng.integers(1, vocab, (batch, length)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[: batch // 2, : length // 4] = False
    tokens[~mask] = 0
    return tokens, mask


def generate_fn(hf, tokens: np.ndarray, mask: np.ndarray, new_tokens: int, device: str = "cpu"):
    """`transformers` sampling of exactly `new_tokens` tokens at temperature 1, as a thunk."""
    import torch

    ids = torch.from_numpy(tokens.astype(np.int64)).to(device)
    att = torch.from_numpy(mask.astype(np.int64)).to(device)

    def generate():
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=att, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        return out

    return generate


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def compiled_sampler(sample, params, tokens: np.ndarray, mask: np.ndarray) -> tuple[float, Callable[[], object]]:
    """(compile seconds, a warmed-up thunk that decodes once and waits for the tokens)."""
    key = jax.random.key(0)
    t0 = time.perf_counter()
    compiled = sample.lower(params, tokens, mask, key).compile()
    compile_s = time.perf_counter() - t0
    decode = lambda: jax.block_until_ready(compiled(params, tokens, mask, key).tokens)
    decode()
    return compile_s, decode


def run(quick: bool = False) -> list[dict]:
    """One row per batch size: tokens/s of both sides, their ratio, and our compile seconds."""
    import torch
    import transformers

    s = QUICK if quick else FULL
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        write_qwen2(Path(tmp), s)
        cfg, graphdef, params = load_hf_model(tmp, max_seq_len=s["prompt"] + s["new_tokens"])
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    # No stop ids: every row emits exactly new_tokens tokens, as generate does.
    sample = make_sampler(graphdef, cfg, max_new_tokens=s["new_tokens"], temperature=1.0, stop_ids=(), pad_id=0)
    default_threads = torch.get_num_threads()
    thread_counts = sorted({1, default_threads})
    rng = np.random.default_rng(0)
    for batch in s["batches"]:
        tokens, mask = prompts(batch, s["prompt"], s["vocab"], rng)
        compile_s, ours = compiled_sampler(sample, params, tokens, mask)
        ours_s = best_time(ours, s["repeats"])

        generate = generate_fn(hf, tokens, mask, s["new_tokens"])
        if batch == s["batches"][0]:  # warm-up (torch compiles nothing: once is enough)
            out = generate()
            assert out.shape == (batch, s["prompt"] + s["new_tokens"]), out.shape
        # torch's default thread count can lose badly to one thread on a busy machine:
        # the reference gets the better setting, timed once each, then best of `repeats`.
        timed = []
        for t in thread_counts:
            torch.set_num_threads(t)
            timed.append((best_time(generate, 1), t))
        threads = min(timed)[1]
        torch.set_num_threads(threads)
        hf_s = min([min(timed)[0]] + [best_time(generate, 1) for _ in range(s["repeats"] - 1)])
        torch.set_num_threads(default_threads)
        # Timed again after the reference, so neither side is favoured by running first.
        ours_s = min(ours_s, best_time(ours, s["repeats"]))
        n = batch * s["new_tokens"]
        rows.append({"batch": batch, "ours_tok_s": n / ours_s, "generate_tok_s": n / hf_s,
                     "ratio": hf_s / ours_s, "compile_s": compile_s, "torch_threads": threads})
    return rows


if __name__ == "__main__":
    for row in run():
        print(row)
