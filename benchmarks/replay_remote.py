"""What a multi-host job's central Reverb table would cost through sidecars (issue 41, item 9).

    .venv/bin/python -m benchmarks.run replay-remote [--quick]

One Reverb server (process 0's table: here in a sidecar of this Python, its gRPC port on
loopback) and four ways to call it, each a real process, for 64 rows of 256 and 2,048 tokens:

  lane-local      Reverb in process on the Reverb lane (`.venv-reverb`): what process 0 pays
                  today (a server of its own, in a process of that Python)
  lane-remote     a Reverb client in a `.venv-reverb` process to the server's gRPC port: what
                  every other process of a Reverb-lane job pays today (`CentralReplay`)
  sidecar-local   this Python to its own sidecar serving the table: what process 0 would pay
  sidecar-remote  this Python to a second sidecar holding only a Reverb client to the server's
                  port (`SidecarServer(connect=...)`): what every other process would pay

ms per call, medians of rounds of 8 calls (2 with --quick): replay_sidecar.timed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.replay import random_items
from benchmarks.replay_sidecar import BATCH, ROOT, TOKENS, timed
from jaxreplay.replay.tables import build_tables

COLUMNS = ("lane-local", "lane-remote", "sidecar-local", "sidecar-remote")


def setup(tokens: int, quick: bool):
    """The benchmark's config (a table that never holds a call back), row spec and rows."""
    import dataclasses

    from benchmarks.replay import unlimited
    from jaxreplay.config import Config
    from jaxreplay.rollout.rollouts import row_spec
    config = Config()
    config = dataclasses.replace(config, sampling=dataclasses.replace(config.sampling, max_new_tokens=tokens // 2),
                                 train=dataclasses.replace(config.train, batch_size=BATCH))
    config = unlimited(config, max_size=4 * BATCH * (2 if quick else 8))
    spec = row_spec(config, prompt_len=tokens // 2)
    return config, spec, random_items(spec, BATCH, np.random.default_rng(0))


def lane(mode: str, tokens: int, quick: bool, address: str = "") -> dict:
    """Under the Reverb lane's Python: Reverb in this process (`local`) or a client to `address`."""
    from jaxreplay.replay.reverb_backend import ReverbClient, ReverbServer
    config, spec, items = setup(tokens, quick)
    if mode == "local":
        with ReverbServer(build_tables(config, spec, "reverb"), timeout_s=60.0) as server:
            return timed(server, config, spec, items, quick)
    client = ReverbClient(address, spec, timeout_s=60.0)
    try:
        return timed(client, config, spec, items, quick)
    finally:
        client.close()


def run_lane(mode: str, tokens: int, quick: bool, address: str = "") -> dict | None:
    python = ROOT / ".venv-reverb" / "bin" / "python"
    if not os.access(python, os.X_OK):
        return None
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([str(python), "-m", "benchmarks.replay_remote", mode, str(tokens), out.name, address,
                        *(["--quick"] if quick else [])], cwd=ROOT, check=True, timeout=900, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def run(quick: bool = False) -> dict:
    """Every column for each row size (this Python must not import Reverb: its sidecars do)."""
    from jaxreplay.replay.sidecar import SidecarServer
    out = {}
    for tokens in TOKENS:
        config, spec, items = setup(tokens, quick)
        tables = build_tables(config, spec, "reverb")
        row = {"lane-local": run_lane("local", tokens, quick)}
        with SidecarServer(tables, timeout_s=60.0) as central:  # process 0's table, in its sidecar
            address = f"localhost:{central.port}"
            row["lane-remote"] = run_lane("remote", tokens, quick, address)
            row["sidecar-local"] = timed(central, config, spec, items, quick)
            with SidecarServer(tables, timeout_s=60.0, connect=address) as remote:
                row["sidecar-remote"] = timed(remote, config, spec, items, quick)
        out[str(tokens)] = row
    return out


def lines(r: dict) -> list[str]:
    out = [f"{'replay-remote (ms per call)':<30}" + "".join(f"{c:>16}" for c in COLUMNS)]
    for tokens, row in r.items():
        for key in ("insert_ms", "sample_ms"):
            out.append(f"{f'{key} {tokens} tok, batch {BATCH}':<30}" +
                       "".join(f"{row[c][key]:>16.2f}" if row.get(c) else f"{'-':>16}" for c in COLUMNS))
        if row.get("lane-remote"):
            out.append(f"{f'  sidecar-remote / lane-remote':<30}" + "".join(
                f"{row['sidecar-remote'][k] / row['lane-remote'][k]:>16.2f}x" for k in ("insert_ms", "sample_ms")))
    return out


if __name__ == "__main__":  # one lane column, as JSON: python -m benchmarks.replay_remote MODE TOKENS OUT [ADDRESS]
    args = [a for a in sys.argv[1:] if a != "--quick"]
    result = lane(args[0], int(args[1]), "--quick" in sys.argv, args[3] if len(args) > 3 else "")
    Path(args[2]).write_text(json.dumps(result))
