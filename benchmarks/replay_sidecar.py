"""Reverb through its sidecar against Reverb in process and the in-process backend, side by side.

    .venv/bin/python -m benchmarks.run replay-sidecar [--quick]

Three columns: `inprocess` (the in-process backend, this Python), `reverb` (Reverb in the
process, run under the Reverb lane's Python, .venv-reverb, as `python -m
benchmarks.replay_sidecar reverb`), `sidecar` (Reverb in its sidecar process, from this
Python). Each column: insert and sample of batches of 64 rows of 256 and 2,048 tokens
(items/s and ms per call, medians of `ROUNDS` rounds), and the demo's replay time per
learner step beside its whole loop's (a colocated demo run; the median of three equal
windows of its steady-state steps, from metrics.jsonl).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.replay import random_items, unlimited
from jaxreplay.config import Config, load_config
from jaxreplay.replay.reader import reader_for
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import build_tables
from jaxreplay.replay.writer import writer_for
from jaxreplay.rollout.rollouts import row_spec

ROOT = Path(__file__).resolve().parents[1]
BATCH = 64
TOKENS = (256, 2048)
ROUNDS = 3
WINDOWS = 3


def calls(backend: str, tokens: int, quick: bool) -> dict:
    """Insert and sample of `BATCH` rows of `tokens` tokens through `backend`'s server: medians of rounds."""
    config = Config()
    config = dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, max_new_tokens=tokens // 2),
                                 train=dataclasses.replace(config.train, batch_size=BATCH))
    config = unlimited(config, max_size=4 * BATCH * (2 if quick else 8))
    spec = row_spec(config, prompt_len=tokens // 2)
    items = random_items(spec, BATCH, np.random.default_rng(0))
    with serve(build_tables(config, spec, backend), timeout_s=60.0) as server:
        ms = timed(server, config, spec, items, quick)
    ins, smp = ms["insert_ms"], ms["sample_ms"]
    return {"tokens": tokens, "insert_ms": ins, "sample_ms": smp, "insert_items_s": BATCH / ins * 1e3,
            "sample_items_s": BATCH / smp * 1e3}


def timed(client, config, spec, items, quick: bool) -> dict:
    """Insert and sample of `BATCH` rows through `client`: ms per call, medians of `ROUNDS` rounds
    of 8 calls (one round of 2 with `quick`), after a first call that opens streams and threads."""
    writer, reader = writer_for(client, config, spec), reader_for(client, config)
    writer.insert(items)
    reader.sample(BATCH)
    n, insert_ms, sample_ms = (2 if quick else 8), [], []
    for _ in range(1 if quick else ROUNDS):
        t0 = time.perf_counter()
        for _ in range(n):
            writer.insert(items)
        insert_ms.append(1e3 * (time.perf_counter() - t0) / n)
        t0 = time.perf_counter()
        for _ in range(n):
            reader.sample(BATCH)
        sample_ms.append(1e3 * (time.perf_counter() - t0) / n)
    return {"insert_ms": statistics.median(insert_ms), "sample_ms": statistics.median(sample_ms)}


def demo(backend: str, quick: bool) -> dict:
    """The demo, colocated on `backend`: replay and loop ms per learner step, in steady state."""
    from jaxreplay.train.driver import train
    steps, warmup = (4, 1) if quick else (70, 10)
    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(ROOT / "configs" / "demo.yaml", [
            f"train.steps={steps}", f"run.dir={run_dir}", "run.progress_bar=false", "warmstart.steps=0",
            f"train.eval_every={steps}", f"replay.backend={backend}"])
        summary = train(config, log=lambda _: None)
        records = [json.loads(line) for line in Path(run_dir, "metrics.jsonl").read_text().splitlines()]
    timed = {r["step"]: r for r in records if "time/replay_s" in r}
    edges = np.linspace(warmup, summary["steps"], WINDOWS + 1).round().astype(int)
    replay_ms, loop_ms = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        spent = {k: timed[b][f"time/{k}_s"] - timed[a][f"time/{k}_s"] for k in ("generate", "train", "replay")}
        replay_ms.append(1e3 * spent["replay"] / (b - a))
        loop_ms.append(1e3 * sum(spent.values()) / (b - a))
    return {"steps": int(edges[-1] - edges[0]), "replay_ms_per_step": statistics.median(replay_ms),
            "loop_ms_per_step": statistics.median(loop_ms),
            "replay_share": statistics.median(r / w for r, w in zip(replay_ms, loop_ms))}


def column(backend: str, quick: bool = False) -> dict:
    return {"calls": [calls(backend, t, quick) for t in TOKENS], "demo": demo(backend, quick)}


def reverb_lane_column(quick: bool, python: str | None = None) -> dict | None:
    """The `reverb` column, measured under the Reverb lane's Python (None where there is none)."""
    python = python or str(ROOT / ".venv-reverb" / "bin" / "python")
    if not os.access(python, os.X_OK):
        return None
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([python, "-m", "benchmarks.replay_sidecar", "reverb", out.name, *(["--quick"] if quick else [])],
                       cwd=ROOT, check=True, timeout=1800, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def run(quick: bool = False, reverb_python: str | None = None) -> dict:
    """The three columns, and the ratios the issue sets goals for."""
    cols = {"inprocess": column("inprocess", quick), "reverb": reverb_lane_column(quick, reverb_python),
            "sidecar": column("reverb", quick)}
    if cols["reverb"] is not None:
        cols["sidecar_vs_reverb_demo_replay"] = (cols["sidecar"]["demo"]["replay_ms_per_step"]
                                                 / cols["reverb"]["demo"]["replay_ms_per_step"])
    return cols


def lines(r: dict) -> list[str]:
    names = [c for c in ("inprocess", "reverb", "sidecar") if r.get(c)]
    out = [f"{'replay-sidecar':<34}" + "".join(f"{c:>14}" for c in names)]
    for i, tokens in enumerate(TOKENS):
        for key, unit in (("insert_ms", "ms"), ("sample_ms", "ms"), ("insert_items_s", "items/s"),
                          ("sample_items_s", "items/s")):
            out.append(f"{f'{key} {tokens} tok, batch {BATCH}':<34}" +
                       "".join(f"{r[c]['calls'][i][key]:>14.1f}" for c in names) + f"  {unit}")
    for key in ("replay_ms_per_step", "loop_ms_per_step"):
        out.append(f"{f'demo {key}':<34}" + "".join(f"{r[c]['demo'][key]:>14.2f}" for c in names))
    out.append(f"{'demo replay share of a step':<34}" +
               "".join(f"{100 * r[c]['demo']['replay_share']:>13.2f}%" for c in names) + "  goal < 5%")
    if "sidecar_vs_reverb_demo_replay" in r:
        out.append(f"{'demo replay: sidecar / reverb':<34}{r['sidecar_vs_reverb_demo_replay']:>14.2f}x  goal <= 1.5x")
    return out


if __name__ == "__main__":  # one column, as JSON: python -m benchmarks.replay_sidecar BACKEND OUT [--quick]
    from jaxreplay.tools.xla_cpu import tune_cpu_compiler
    tune_cpu_compiler()
    result = column(sys.argv[1], "--quick" in sys.argv)
    Path(sys.argv[2]).write_text(json.dumps(result))
