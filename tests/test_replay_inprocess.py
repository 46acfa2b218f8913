"""The in-process replay backend on its own (it runs where Reverb cannot install):
imports, blocking with timeouts, checkpoints. tests/test_replay_differential.py holds
it to Reverb's behaviour."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxreplay.config import load_config
from jaxreplay.replay.inprocess import InProcessServer
from jaxreplay.replay.reader import RolloutReader
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import ReplayTimeoutError, build_tables
from jaxreplay.replay.writer import RolloutWriter

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(60, method="thread")

SPEC = {"tokens": ((3,), np.int32), "reward": ((), np.float32), "policy_version": ((), np.int32)}
CFG = ("train.batch_size=4", "train.prompts_per_step=2", "train.group_size=2", "replay.max_size=6",
       "replay.min_size_to_sample=2", "replay.samples_per_insert=2", "replay.error_buffer=4")


def rollouts(ids):
    ids = np.asarray(list(ids), np.int32)
    return {"tokens": np.stack([ids, ids + 1, ids + 2], axis=1), "reward": ids.astype(np.float32) % 2,
            "policy_version": ids}


def server(*overrides, **kwargs) -> InProcessServer:
    return serve(build_tables(load_config(None, [*CFG, *overrides]), SPEC, "inprocess"), **kwargs)


def test_importing_replay_imports_neither_reverb_nor_tensorflow():
    code = ("import sys, jaxreplay.replay, jaxreplay.train.driver; "
            "print(sorted(m for m in ('reverb', 'tensorflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_auto_backend_without_reverb_is_inprocess(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reverb" else real(name, *a))
    assert isinstance(serve(build_tables(load_config(None, list(CFG)), SPEC)), InProcessServer)


def test_blocked_calls_time_out_with_the_limiter_state():
    with server(timeout_s=1) as s:
        reader, writer = RolloutReader(s, timeout_s=0.2), RolloutWriter(s, SPEC, timeout_s=0.2)
        t0 = time.monotonic()
        with pytest.raises(ReplayTimeoutError, match=r"size=0, inserts=0"):
            reader.sample(1)  # below min_size_to_sample
        writer.insert(rollouts(range(4)))  # diff 8 = offset 4 + buffer 4: the window is full
        with pytest.raises(ReplayTimeoutError, match=r"insert of 1 rows timed out .* inserts=4"):
            writer.insert(rollouts([4]))
        assert time.monotonic() - t0 < 1.5
        assert s.states()["rollouts"].inserts == 4


def test_a_blocked_sample_is_woken_by_an_insert_from_another_thread():
    with server() as s:
        reader = RolloutReader(s, timeout_s=10)
        threading.Timer(0.2, lambda: RolloutWriter(s, SPEC, timeout_s=5).insert(rollouts(range(2)))).start()
        batch, info = reader.sample(2)
        assert sorted(batch["tokens"][:, 0]) == sorted(batch["policy_version"])
        assert set(batch["policy_version"]) <= {0, 1} and (info.table_size == 2).all()


def test_checkpoint_restores_items_and_counters_exactly(tmp_path):
    with server("replay.positive_fraction=0.5", checkpoint_root=tmp_path) as s:
        RolloutWriter(s, SPEC, timeout_s=5, positive_table="positives").insert(rollouts(range(5)))
        RolloutReader(s, timeout_s=5).sample(3)
        name = s.checkpoint()
        before = s.states()
        rows_before = {t: [(it.key, it.times_sampled, it.row["policy_version"].item()) for it in tab.items]
                       for t, tab in s._tables.items()}
    assert not os.path.isabs(name)  # relative to checkpoint_root: run dirs can move
    path = tmp_path / name
    assert sorted(os.listdir(path)) == ["DONE", "positives.npz", "rollouts.npz", "tables.json"]
    json.load(open(os.path.join(path, "tables.json")))
    with np.load(os.path.join(path, "rollouts.npz"), allow_pickle=False) as z:
        assert z["field.tokens"].shape == (3, 3)  # the main table holds N - dN = 3
    with server("replay.positive_fraction=0.5", checkpoint_root=tmp_path, restore_from=name) as s:
        assert s.states() == before
        assert {t: [(it.key, it.times_sampled, it.row["policy_version"].item()) for it in tab.items]
                for t, tab in s._tables.items()} == rows_before
        assert s.prune(keep={name}) == []


def test_restore_refuses_other_settings_and_incomplete_checkpoints(tmp_path):
    with server(checkpoint_root=tmp_path) as s:
        name = s.checkpoint()
    with pytest.raises(ValueError, match=r"different table settings: rate_limit"):
        server("replay.samples_per_insert=3", checkpoint_root=tmp_path, restore_from=name)
    with pytest.raises(ValueError, match=r"nope/DONE: missing \(the marker of a complete replay checkpoint\)"):
        server(checkpoint_root=tmp_path, restore_from="nope")
    with pytest.raises(ValueError, match="relative to a checkpoint_root; none was given"):
        server(restore_from=name)


def test_seeded_servers_sample_alike_and_a_restore_continues_the_same_draws(tmp_path):
    """The uniform selector draws from the server's RNG: the same seed gives the same samples,
    and a restored checkpoint carries the RNG on where the saved server left it."""
    def keys(s, n=6):
        return list(RolloutReader(s, timeout_s=1).sample(n)[1].keys)

    with server("replay.max_size=64", "replay.error_buffer=40", seed=3, checkpoint_root=tmp_path) as a, \
            server("replay.max_size=64", "replay.error_buffer=40", seed=3) as b, \
            server("replay.max_size=64", "replay.error_buffer=40", seed=4) as other:
        for s in (a, b, other):
            RolloutWriter(s, SPEC, timeout_s=1).insert(rollouts(range(20)))
        assert keys(a) == keys(b) != keys(other)
        path = a.checkpoint()
        after = keys(a)
    with server("replay.max_size=64", "replay.error_buffer=40", seed=3, checkpoint_root=tmp_path,
                restore_from=path) as restored:
        assert keys(restored) == after


@pytest.mark.parametrize("call", ["sample", "insert"])
def test_sigterm_ends_a_blocked_call_within_a_slice(call):
    """A blocked call waits in slices, so SIGTERM's handler runs, and the preemption flag
    it sets ends the wait in ReplayInterrupted rather than at the timeout."""
    from jaxreplay.replay.tables import ReplayInterrupted
    from jaxreplay.train.guards import PreemptionNotice

    notice = PreemptionNotice()  # this test runs on the main thread
    try:
        with server(timeout_s=30) as s:
            reader = RolloutReader(s, timeout_s=30, interrupted=notice.is_set)
            writer = RolloutWriter(s, SPEC, timeout_s=30, interrupted=notice.is_set)
            if call == "insert":
                writer.insert(rollouts(range(4)))  # the window is full: the next insert waits for a sample
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
            start = time.monotonic()
            with pytest.raises(ReplayInterrupted, match=f"table 'rollouts'"):
                reader.sample(1) if call == "sample" else writer.insert(rollouts([4]))
            assert 0.25 < time.monotonic() - start < 1.0
    finally:
        notice.close()


def _documented_arrays() -> dict[str, tuple[str, str]]:
    """docs/checkpoints.md's table of a replay checkpoint's arrays: name -> (shape, dtype)."""
    text = (ROOT / "docs" / "checkpoints.md").read_text().split("## The rows of a replay checkpoint")[1].split("\n## ")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| `")]
    return {name.strip("`"): (shape, dtype) for name, shape, dtype, _ in rows}


def test_the_documented_rows_of_a_replay_checkpoint_are_what_the_backend_writes(tmp_path):
    """Issue 58 item 8: outside tools read RUN/replay/<name>/rollouts.npz by docs/checkpoints.md's field list."""
    from jaxreplay.replay.inprocess import ITEM_ARRAYS, read_table
    from jaxreplay.rollout.rollouts import make_rows, row_spec

    documented = _documented_arrays()
    config = load_config(None, [*CFG, "sampling.engine=continuous", "sampling.max_new_tokens=3"])
    spec = row_spec(config, prompt_len=2)  # T = 5
    n = 4
    rows = make_rows(spec, **{k: np.arange(n * int(np.prod(shape))).reshape(n, *shape) % 2
                              for k, (shape, _) in spec.items()})
    with serve(build_tables(config, spec, "inprocess"), checkpoint_root=tmp_path) as s:
        RolloutWriter(s, spec, timeout_s=5).insert(rows)
        RolloutReader(s, timeout_s=5).sample(2)
        path = tmp_path / s.checkpoint()
    with np.load(path / "rollouts.npz", allow_pickle=False) as z:
        written = {k: z[k] for k in z.files}
    assert set(written) == set(documented)
    for name, array in written.items():
        shape, dtype = documented[name]
        assert (array.dtype.name, shape) == (dtype, "[n, T]" if array.ndim == 2 else "[n]"), name
        assert array.shape[0] == n and (array.ndim == 1 or array.shape[1] == 5), name
    meta = json.loads((path / "tables.json").read_text())
    assert set(meta) == {"format", "next_key", "rng", "tables"} and meta["format"] == 2
    assert set(meta["tables"][0]) == {"definition", "inserts", "samples", "sha256"}
    # the static engine's rows leave out last_version alone, as the table says
    static = row_spec(load_config(None, list(CFG)), prompt_len=2)
    assert {f"field.{k}" for k in static} | {"field.last_version", *ITEM_ARRAYS} == set(documented)
    # the reader: the same arrays by name, `field.` left off, once the hashes match
    read = read_table(path)
    assert set(read) == {k.removeprefix("field.") for k in written}
    assert all(np.array_equal(read[k.removeprefix("field.")], v) for k, v in written.items())
    assert read["times_sampled"].sum() == 2 and np.array_equal(read["tokens"], rows["tokens"])
    with pytest.raises(KeyError, match=r"no table 'positives' .*\(tables: rollouts\)"):
        read_table(path, "positives")
