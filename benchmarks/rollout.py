"""Rollout throughput: the engine (rollout/engine.py) against the static sampler, side by side.

    .venv/bin/python -m benchmarks.run rollout [--quick]

Three workloads (issue 30), one line each, in this order:
  long-tail      random Qwen2-shaped weights (the sampler benchmark's shape), logits flattened
                 (lm_head x 0.01) and 8 of the 512 tokens stop ids, so every step stops a row
                 with probability ~1/64: lengths geometric with mean ~64, capped at 512.
                 R = 512 rollouts (64 prompts x G = 8); static batches of 64 rows (8 prompts x 8),
                 the engine 64 slots. Unit: completion tokens (through the stop) per second.
  shared-prompt  512-token prompts, G = 16, 64-token completions (no stop), 64 rows or slots,
                 128 rollouts a round. Unit: rollouts per second.
  demo-long      configs/demo_long.yaml's model (random init) and task: a training step's prompts
                 (8 x G = 8) sampled, scored and made into replay rows, as the actor does.
                 Unit: rollouts per second.
Then `full-batch`: the sampler benchmark's batch 64 (32 + 128 tokens, no stop, G = 1), every
slot busy: the engine's per-token speed must not fall below the static sampler's there. Its
static side is timed twice a round; `static_vs_itself` (the second median over the first) is
the noise its ratio is read against.
Each round times one side then the other (which goes first alternates); each side's figure is
the median over rounds, after a warm-up round that compiles. `ratio` = engine / static; `load`
is the 1-minute load average as the line is printed (the machine's noise).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import jax
import numpy as np

from jaxreplay.config import ModelConfig, load_config
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.actor import Actor
from jaxreplay.rollout.advantages import ADVANTAGES
from jaxreplay.rollout.engine import JaxEngine, PromptGroup, pool_cache_bytes
from jaxreplay.rollout.sampling import make_run_samplers, make_sampler
from jaxreplay.tasks.base import score
from jaxreplay.tasks.registry import make_task

FULL = dict(vocab=512, width=256, layers=4, heads=8, kv_heads=2, head_dim=32, d_ff=704, rounds=5,
            tail=dict(prompts=64, group=8, prompt=32, cap=512, batch=64, chunk=16, stops=8),
            shared=dict(prompts=8, group=16, prompt=512, new=64, batch=64, chunk=16),
            demo=dict(chunk=8), full=dict(rows=64, prompt=32, new=128, chunk=16),
            chunks=dict(demo=(4, 8, 16, 21), full=(8, 16, 32, 64)))
# benchmarks/device.sh --rollout: Qwen2.5-0.5B's shape in bfloat16 (lm_head untied, for the stop
# bias), long-tail and shared-prompt only, 3 rounds: under 5 minutes on one accelerator.
DEVICE = dict(vocab=151_936, width=896, layers=24, heads=14, kv_heads=2, head_dim=64, d_ff=4864, rounds=3,
              dtype="bfloat16", tail=dict(prompts=64, group=8, prompt=32, cap=512, batch=64, chunk=16,
                                          stops=151_936 // 64),
              shared=dict(prompts=8, group=16, prompt=512, new=64, batch=64, chunk=16))
QUICK = dict(vocab=64, width=32, layers=1, heads=2, kv_heads=1, head_dim=16, d_ff=64, rounds=1,
             tail=dict(prompts=4, group=2, prompt=8, cap=16, batch=4, chunk=4, stops=4),
             shared=dict(prompts=2, group=4, prompt=16, new=4, batch=4, chunk=2),
             demo=dict(chunk=8), full=dict(rows=4, prompt=8, new=8, chunk=4),
             chunks=dict(demo=(8, 21), full=(4, 8)))


def model(s: dict, max_len: int, seed: int = 0, flatten: float = 1.0):
    cfg = ModelConfig(vocab_size=s["vocab"], d_model=s["width"], n_layers=s["layers"], n_heads=s["heads"],
                      n_kv_heads=s["kv_heads"], head_dim=s["head_dim"], d_ff=s["d_ff"], max_seq_len=max_len,
                      rope_theta=1e6, tie_embeddings=False, attention_bias=True,
                      param_dtype=s.get("dtype", "float32"), compute_dtype=s.get("dtype", "float32"))
    graphdef, params = init_params(cfg, seed)
    if flatten != 1.0:
        params["lm_head"]["kernel"][...] = params["lm_head"]["kernel"][...] * flatten
    return cfg, graphdef, params


def random_prompts(n: int, length: int, vocab: int, low: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(low, vocab, (n, length)).astype(np.int32), np.ones((n, length), bool)


def group_list(tokens, mask, seed: int) -> list[PromptGroup]:
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(seed), np.arange(len(tokens)))  # one dispatch
    return [PromptGroup(i, tokens[i], mask[i], key) for i, key in enumerate(keys)]


def run_engine(engine: JaxEngine, groups: list[PromptGroup]) -> list:
    """Every group's completions, stepping until all are collected."""
    engine.submit(groups)
    done = []
    while engine.pending():
        engine.step()
        done.extend(engine.collect())
    return done


def run_static(sample, params, tokens, mask, group: int, batch: int, seed: int) -> list:
    """Batches of `batch` rows (batch / group prompts, each repeated G times), one call each."""
    per_call = batch // group
    out = []
    for k in range(0, len(tokens), per_call):
        t, m = np.repeat(tokens[k:k + per_call], group, 0), np.repeat(mask[k:k + per_call], group, 0)
        out.append(jax.device_get(sample(params, t, m, jax.random.key(seed + k))))
    return out


def alternating(sides: dict[str, Callable], rounds: int) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Each side's seconds per round, the order of the sides reversed every other round, and each
    side's last output."""
    seconds, outputs = {label: [] for label in sides}, {}
    for r in range(rounds):
        for label, fn in (list(sides.items()) if r % 2 == 0 else list(sides.items())[::-1]):
            t0 = time.perf_counter()
            outputs[label] = fn()
            seconds[label].append(time.perf_counter() - t0)
    return seconds, outputs


def side_by_side(static, engine, rounds: int, static_warmup=None) -> tuple[list[float], list[float], object, object]:
    """Each side's seconds per round (a warm-up round first, untimed: `static_warmup` if given, a
    shorter run that compiles the same program); the order alternates. Returns each side's last
    output too."""
    (static_warmup or static)()
    engine()  # compiles (the prefill programs used depend on the whole run)
    seconds, outputs = alternating({"static": static, "engine": engine}, rounds)
    return seconds["static"], seconds["engine"], outputs["static"], outputs["engine"]


def long_tail(s: dict) -> dict:
    w = s["tail"]
    cfg, graphdef, params = model(s, w["prompt"] + w["cap"], flatten=0.01)
    stops = tuple(range(s["vocab"] - w["stops"], s["vocab"]))
    tokens, mask = random_prompts(w["prompts"], w["prompt"], s["vocab"] - w["stops"], 1, seed=1)
    settings = dict(temperature=1.0, stop_ids=stops, pad_id=0)
    sample = make_sampler(graphdef, cfg, max_new_tokens=w["cap"], **settings)
    per_call = w["batch"] // w["group"]
    engine = JaxEngine(graphdef, cfg, params, slots=w["batch"], group_size=w["group"], prompt_len=w["prompt"],
                       max_new_tokens=w["cap"], chunk_steps=w["chunk"], **settings)
    static_s, engine_s, static_out, engine_out = side_by_side(
        lambda: run_static(sample, params, tokens, mask, w["group"], w["batch"], seed=0),
        lambda: run_engine(engine, group_list(tokens, mask, seed=0)), s["rounds"],
        static_warmup=lambda: run_static(sample, params, tokens[:per_call], mask[:per_call], w["group"], w["batch"],
                                         seed=0))
    static_tokens = sum(int(r.completion_mask.sum()) for r in static_out)
    engine_tokens = sum(int(c.rollout.completion_mask.sum()) for c in engine_out)
    rows = w["prompts"] * w["group"]
    return _line("long-tail", "tok/s", static_tokens / statistics.median(static_s),
                 engine_tokens / statistics.median(engine_s), static_s, engine_s,
                 rollouts=rows, mean_len_static=static_tokens / rows, mean_len_engine=engine_tokens / rows,
                 **_engine_step(engine, engine_s, cfg, params, w["batch"], w["prompt"], w["cap"]))


def shared_prompt(s: dict) -> dict:
    w = s["shared"]
    cfg, graphdef, params = model(s, w["prompt"] + w["new"])
    tokens, mask = random_prompts(w["prompts"], w["prompt"], s["vocab"], 1, seed=2)
    settings = dict(temperature=1.0, stop_ids=(), pad_id=0)
    sample = make_sampler(graphdef, cfg, max_new_tokens=w["new"], **settings)
    engine = JaxEngine(graphdef, cfg, params, slots=w["batch"], group_size=w["group"], prompt_len=w["prompt"],
                       max_new_tokens=w["new"], chunk_steps=w["chunk"], **settings)
    static_s, engine_s, _, _ = side_by_side(
        lambda: run_static(sample, params, tokens, mask, w["group"], w["batch"], seed=0),
        lambda: run_engine(engine, group_list(tokens, mask, seed=0)), s["rounds"])
    rows = w["prompts"] * w["group"]
    return _line("shared-prompt", "rollouts/s", rows / statistics.median(static_s),
                 rows / statistics.median(engine_s), static_s, engine_s, rollouts=rows,
                 **_engine_step(engine, engine_s, cfg, params, w["batch"], w["prompt"], w["new"]))


def _engine_step(engine: JaxEngine, seconds, cfg, params, slots: int, prompt: int, new: int) -> dict:
    """Seconds per engine decode step (a round's wall time, prefill and host work included, over
    its steps) and the bytes a step reads: every weight and the cache columns its rows attend
    over (the window, on the slots the chunk ran on), averaged over the steps."""
    stats = engine.stats
    steps = stats.decode_steps / (len(seconds) + 1)  # the warm-up round counted too
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    column = pool_cache_bytes(cfg, 1, 1, 0)  # one row's K and V of one position, every layer
    return {"engine_step_s": statistics.median(seconds) / max(steps, 1),
            "engine_step_bytes": weights + column * stats.cache_columns / max(stats.decode_steps, 1)}


def demo_long_actors() -> tuple[int, Callable, Callable[[int], Callable]]:
    """configs/demo_long.yaml's model (random init) and task: (rollouts a step, the static actor's
    step, and for a chunk length K the engine actor's step: the same prompts sampled, scored and
    advantaged per group)."""
    c = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "demo_long.yaml"))
    task = make_task(c.task)
    graphdef, params = init_params(c.model, c.run.seed)
    tok = task.tokenizer
    sample, _ = make_run_samplers(graphdef, c, stop_ids=tok.eos_ids, pad_id=tok.pad_id)
    actor = Actor(c, task, sample)
    group, rows = c.train.group_size, c.train.prompts_per_step * c.train.group_size
    problems = task.train_problems(c.run.seed, 0, c.train.prompts_per_step)
    tokens, mask = task.encode_prompts(problems)

    def engine_actor(k: int) -> Callable:
        engine = JaxEngine(graphdef, c.model, params, slots=rows, group_size=group, prompt_len=task.prompt_len,
                           max_new_tokens=c.sampling.max_new_tokens, chunk_steps=k,
                           temperature=c.sampling.temperature, top_k=c.sampling.top_k, top_p=c.sampling.top_p,
                           stop_ids=tok.eos_ids, pad_id=tok.pad_id)

        def act():
            done = sorted(run_engine(engine, group_list(tokens, mask, seed=0)), key=lambda d: d.tag)
            completions = [row[keep] for d in done for row, keep in zip(d.rollout.tokens, d.rollout.completion_mask)]
            rewards, _ = score(task, problems, completions, group)
            return ADVANTAGES[c.train.advantage](rewards.reshape(-1, group))
        return act

    return rows, lambda: actor.act(params, 0, 0), engine_actor


def demo_long(s: dict) -> dict:
    """The actor's work for one training step of demo_long: sample, score, make rows."""
    rows, static_act, engine_actor = demo_long_actors()
    static_s, engine_s, _, _ = side_by_side(static_act, engine_actor(s["demo"]["chunk"]), s["rounds"])
    return _line("demo-long", "rollouts/s", rows / statistics.median(static_s), rows / statistics.median(engine_s),
                 static_s, engine_s, rollouts=rows)


def full_batch_sides(s: dict) -> tuple[int, Callable, Callable[[int], Callable]]:
    """The sampler benchmark's batch 64 (32-token prompts, 128 new tokens, no stop), one prompt a
    group (G = 1) so both sides prefill 64 rows: (tokens a round, the static side, and for a chunk
    length K the engine side)."""
    w = s["full"]
    cfg, graphdef, params = model(s, w["prompt"] + w["new"])
    tokens, mask = random_prompts(w["rows"], w["prompt"], s["vocab"], 1, seed=3)
    settings = dict(temperature=1.0, stop_ids=(), pad_id=0)
    sample = make_sampler(graphdef, cfg, max_new_tokens=w["new"], **settings)

    def engine_side(k: int) -> Callable:
        engine = JaxEngine(graphdef, cfg, params, slots=w["rows"], group_size=1, prompt_len=w["prompt"],
                           max_new_tokens=w["new"], chunk_steps=k, **settings)
        return lambda: run_engine(engine, group_list(tokens, mask, seed=0))

    return w["rows"] * w["new"], lambda: run_static(sample, params, tokens, mask, 1, w["rows"], seed=0), engine_side


def full_batch(s: dict) -> dict:
    """Per-token speed with every slot busy: the engine's must not fall below the static sampler's.
    The static side is timed twice in each round, as two sides: how far apart its two medians
    are (`static_vs_itself`) is the noise a ratio near 1 has to be read against."""
    n, static, engine_side = full_batch_sides(s)
    engine = engine_side(s["full"]["chunk"])
    static(), engine()  # compiles
    seconds, _ = alternating({"static": static, "engine": engine, "static again": static}, s["rounds"])
    static_s, engine_s, again_s = seconds["static"], seconds["engine"], seconds["static again"]
    return _line("full-batch", "tok/s", n / statistics.median(static_s), n / statistics.median(engine_s),
                 static_s, engine_s, static_vs_itself=statistics.median(again_s) / statistics.median(static_s))


def chunk_lengths(quick: bool = False) -> list[dict]:
    """demo-long and full-batch with the engine at several chunk lengths K (and the static side),
    all side by side in alternating rounds: what the per-chunk host round trip costs against
    what longer chunks cost (a chunk attends over the width its longest row reaches by its end)."""
    s, out = QUICK if quick else FULL, []
    for name, (_, static, engine_side), default, ks in (
            ("demo-long", demo_long_actors(), s["demo"]["chunk"], s["chunks"]["demo"]),
            ("full-batch", full_batch_sides(s), s["full"]["chunk"], s["chunks"]["full"])):
        sides = {"static": static, **{f"K={k}": engine_side(k) for k in ks}}
        for fn in sides.values():
            fn()  # compiles
        seconds, _ = alternating(sides, s["rounds"])
        medians = {label: statistics.median(t) for label, t in seconds.items()}
        for label, m in medians.items():
            out.append({"workload": name, "side": label, "seconds": m, "default_chunk": default,
                        "vs_default": medians[f"K={default}"] / m, "load": os.getloadavg()[0]})
            print(f"rollout-chunks {name} {label} ms={1e3 * m:.1f} speed_vs_K={default}={out[-1]['vs_default']:.2f} "
                  f"(medians of {s['rounds']} rounds, load {out[-1]['load']:.1f})", flush=True)
    return out


def _line(name: str, unit: str, static: float, engine: float, static_s, engine_s, **extra) -> dict:
    return {"workload": name, "unit": unit, "static": static, "engine": engine, "ratio": engine / static,
            "static_seconds": static_s, "engine_seconds": engine_s, "load": os.getloadavg()[0], **extra}


def line(r: dict) -> str:
    """`rollout NAME static=... engine=... UNIT ratio=...`: the printed form."""
    more = "".join(f" {k}={r[k]:.1f}" for k in ("mean_len_static", "mean_len_engine") if k in r)
    noise = f" static_vs_itself={r['static_vs_itself']:.2f}" if "static_vs_itself" in r else ""
    return (f"rollout {r['workload']} static={r['static']:.1f} engine={r['engine']:.1f} {r['unit']} "
            f"ratio={r['ratio']:.2f}{noise} (medians of {len(r['static_seconds'])} rounds{more}, load {r['load']:.1f})")


def run(quick: bool = False) -> list[dict]:
    """The three workloads, then the full-batch check, each line printed as it is measured."""
    s = QUICK if quick else FULL
    rows = []
    for fn in (long_tail, shared_prompt, demo_long, full_batch):
        rows.append(fn(s))
        print(line(rows[-1]), flush=True)
    return rows


def main(argv=None) -> None:
    """`python -m benchmarks.rollout --device --out DIR`: long-tail and shared-prompt on a
    0.5B-shaped bf16 model (benchmarks/device.sh --rollout), with the share of HBM bandwidth an
    engine decode step reaches; `--quick` is the tiny dry run on any backend."""
    import argparse
    import json
    from pathlib import Path

    from benchmarks.device import CHIPS, check_machine

    parser = argparse.ArgumentParser(description=main.__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for rollout.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes on any backend: a dry run")
    parser.add_argument("--hbm-gbps", type=float, help="chip HBM GB/s (default: by device kind)")
    args = parser.parse_args(argv)
    check_machine(args.quick)  # a full run needs a current JAX on an accelerator
    device = jax.devices()[0]
    bandwidth = args.hbm_gbps * 1e9 if args.hbm_gbps else CHIPS.get(device.device_kind, (None, None))[1]
    s = QUICK if args.quick else DEVICE
    results = {"device": device.device_kind, "hbm_bytes_s": bandwidth, "rollout": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fn in (long_tail, shared_prompt):
        r = fn(s)
        if bandwidth:
            r["engine_hbm_fraction"] = r["engine_step_bytes"] / r["engine_step_s"] / bandwidth
        results["rollout"].append(r)
        hbm = f" hbm={100 * r['engine_hbm_fraction']:.0f}%" if bandwidth else " hbm=? (unknown chip)"
        print(line(r) + f" engine_step={1e3 * r['engine_step_s']:.2f}ms{hbm}", flush=True)
        (out / "rollout.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    import sys

    from benchmarks.device import DeviceError

    try:
        main()
    except DeviceError as e:
        print(f"rollout: {e}", file=sys.stderr)
        sys.exit(2)
