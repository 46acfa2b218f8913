"""What the checkpoint checksums cost at save and at restore (issue 33): the same Orbax save of
the same state, with the on-device digests (jaxreplay.train.checkpoint.digests) and without, medians of 3,
interleaved, on the demo model's params + Adam state and on a 100M-parameter float32 tree.

    .venv/bin/python -m benchmarks.checksums [--big-params 100e6] [--repeats 3] [--dir /tmp]

Prints one JSON line per tree: seconds with and without, their ratio, the digest alone (after its
compile, and the first call, compile included), and the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxreplay.config import load_config
from jaxreplay.learn.learner import make_optimizer
from jaxreplay.models.transformer import init_params
from jaxreplay.train import checkpoint
from jaxreplay.train.checkpoint import Checkpointer, Progress

ROOT = Path(__file__).resolve().parents[1]


def demo_state() -> dict:
    c = load_config(ROOT / "configs" / "demo.yaml", [])
    _, params = init_params(c.model, 0)
    return {"params": params, "opt_state": make_optimizer(c.train).init(params)}


def big_state(n: float) -> dict:
    """float32 leaves of 2048 x 4096 (8.4M each) adding up to about `n` parameters."""
    leaves = max(1, round(n / (2048 * 4096)))
    key = jax.random.key(0)
    return {"params": {f"w{i}": jax.random.normal(jax.random.fold_in(key, i), (2048, 4096), jnp.float32)
                       for i in range(leaves)}}


def size(tree) -> int:
    return sum(x.size for x in jax.tree.leaves(tree))


def measure(name: str, state: dict, repeats: int, root: Path) -> dict:
    real = checkpoint.digests
    t0 = time.perf_counter()
    real(state)  # compiles
    first = time.perf_counter() - t0
    alone = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        real(state)
        alone.append(time.perf_counter() - t0)
    times = {"with": [], "without": []}
    for r in range(repeats):
        for mode in ("without", "with"):
            directory = root / f"{name}-{mode}-{r}"
            ckpt = Checkpointer(directory, keep=1)
            checkpoint.digests = real if mode == "with" else (lambda tree: {})
            try:
                t0 = time.perf_counter()
                ckpt.save(1, state, Progress(learner_step=1))
                times[mode].append(time.perf_counter() - t0)
            finally:
                checkpoint.digests = real
                ckpt.close()
                shutil.rmtree(directory, ignore_errors=True)
    with_s, without_s = statistics.median(times["with"]), statistics.median(times["without"])
    return {"tree": name, "params": size(state), "bytes": sum(x.nbytes for x in jax.tree.leaves(state)),
            "save_s_without": round(without_s, 3), "save_s_with": round(with_s, 3),
            "ratio": round(with_s / without_s, 3), "digest_s": round(statistics.median(alone), 4),
            "digest_first_call_s": round(first, 3), "repeats": repeats,
            "backend": jax.default_backend(), "loadavg": [round(x, 2) for x in os.getloadavg()]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-params", type=float, default=100e6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="checksums-bench-", dir=args.dir))
    try:
        for name, make in (("demo", demo_state), ("big", lambda: big_state(args.big_params))):
            state = jax.block_until_ready(make())
            print(json.dumps(measure(name, state, args.repeats, root)), flush=True)
            del state
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
