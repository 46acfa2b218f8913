"""jaxreplay.replay against a real Reverb server: items, rate limiting, selectors, checkpoints."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("reverb", reason="needs dm-reverb (the `reverb` extra; Python 3.10/3.11)")

from jaxreplay.config import ConfigError, load_config, validate
from jaxreplay.replay.ports import PortInUseError, check_port
from jaxreplay.replay.reader import RolloutReader
from jaxreplay.replay.backend import DamagedCheckpoint
from jaxreplay.replay.reverb_backend import ReverbServer, verify
from jaxreplay.replay.tables import (
    TABLE_NAME, ReplayInterrupted, ReplayTimeoutError, TableSharedError, build_tables)
from jaxreplay.replay.writer import RolloutWriter
from jaxreplay.train.guards import PreemptionNotice
from replay_rows import SPEC, T, rollouts  # noqa: F401 - T: the rows' token count

# A regression here tends to hang inside Reverb's C++ (no Python signal gets in):
# the thread method ends the run instead of waiting for the global timeout.
pytestmark = [pytest.mark.needs_reverb, pytest.mark.timeout(60, method="thread")]

def config(*overrides: str):
    return load_config(None, list(overrides))


@dataclasses.dataclass
class Replay:
    server: ReverbServer
    table: object  # the reverb.Table the server was built from
    writer: RolloutWriter
    reader: RolloutReader

    def state(self):
        """The rollout table's state, asked of the server."""
        return self.server.states()[TABLE_NAME]


def reverb_server(cfg, spec=SPEC, **server_kwargs) -> ReverbServer:
    return ReverbServer(build_tables(cfg, spec, "reverb"), **server_kwargs)


@contextlib.contextmanager
def serve(cfg, timeout_s: float = 2.0, **server_kwargs):
    with reverb_server(cfg, **server_kwargs) as server:
        writer = RolloutWriter(server, SPEC, timeout_s=timeout_s)
        yield Replay(server, server.reverb_tables[0], writer, RolloutReader(server, timeout_s=timeout_s))


def assert_rows_equal(batch, ids):
    expected = rollouts(ids)
    for k, (shape, dtype) in SPEC.items():
        assert batch[k].dtype == dtype and batch[k].shape == (len(ids), *shape), k
        np.testing.assert_array_equal(batch[k], expected[k], err_msg=k)


# Generous window: lots of sampling allowed, for tests not about the limiter.
LOOSE = ("train.batch_size=4", "replay.min_size_to_sample=4", "replay.max_size=64",
         "replay.error_buffer=1000")


# 1. Items ---------------------------------------------------------------------------


def test_items_round_trip_exactly():
    with serve(config(*LOOSE)) as r:
        r.writer.insert(rollouts(range(6)))
        batch, info = r.reader.sample(32)
    ids = batch["policy_version"]
    assert set(ids) <= set(range(6)) and len(set(ids)) > 1
    assert_rows_equal(batch, ids)
    assert info.keys.dtype == np.uint64 and info.keys.shape == (32,)
    # Same id, same Reverb key, and times_sampled counts up per key.
    assert len(set(info.keys)) == len(set(ids))
    assert info.times_sampled.min() >= 1 and info.times_sampled.max() <= 32
    np.testing.assert_allclose(info.probabilities, 1 / 6)
    np.testing.assert_array_equal(info.table_size, 6)


def test_writer_rejects_rows_that_do_not_match_the_spec():
    with serve(config(*LOOSE)) as r:
        good = rollouts(range(3))
        with pytest.raises(ValueError, match="'tokens': expected \\[n, 5\\] int32, got \\[3, 5\\] int64"):
            r.writer.insert({**good, "tokens": good["tokens"].astype(np.int64)})
        with pytest.raises(ValueError, match="'reward': expected \\[n\\] float32, got \\[3, 1\\]"):
            r.writer.insert({**good, "reward": good["reward"][:, None]})
        with pytest.raises(ValueError, match="missing \\['reward'\\], unexpected \\['score'\\]"):
            r.writer.insert({**{k: v for k, v in good.items() if k != "reward"}, "score": good["reward"]})
        with pytest.raises(ValueError, match="rows"):
            r.writer.insert({**good, "advantage": good["advantage"][:2]})
        with pytest.raises(ValueError, match="priorities"):
            r.writer.insert(good, priorities=np.ones(2))
        assert r.state().inserts == 0


# 2. The rate limiter ----------------------------------------------------------------


def test_limiter_holds_samples_per_insert():
    b, chunk = 8, 4
    cfg = config(f"train.batch_size={b}", "replay.samples_per_insert=2", "replay.min_size_to_sample=16",
                 "replay.max_size=64", "replay.error_buffer=12")  # 2 * 12 >= b + 2 * chunk
    with serve(cfg) as r:
        next_id = 0
        while (state := r.state()).inserts < 400:
            if state.size >= 16:
                assert state.min_diff <= state.diff <= state.max_diff, state.describe()
            if state.can_sample(b):
                r.reader.sample(b)
            else:
                assert state.can_insert(chunk), state.describe()
                r.writer.insert(rollouts(range(next_id, next_id + chunk)))
                next_id += chunk
        assert abs(state.ratio - 2.0) <= 0.2, state.describe()


def test_insert_past_the_window_times_out_naming_the_limiter_state():
    cfg = config("train.batch_size=4", "replay.min_size_to_sample=4", "replay.samples_per_insert=2")
    with serve(cfg, timeout_s=0.5) as r:
        start = time.monotonic()
        with pytest.raises(ReplayTimeoutError) as e:
            r.writer.insert(rollouts(range(100)))  # no sampler: the window fills
        assert 0.4 < time.monotonic() - start < 3.0
        message = str(e.value)
        assert "\n" not in message and "insert of 100 rows timed out" in message
        state = r.state()
        assert f"table '{TABLE_NAME}'" in message and f"samples={state.samples}" in message
        assert "inserts=" in message and "window=[" in message
        assert not state.can_insert(1)


def test_sample_from_an_empty_table_times_out():
    with serve(config(*LOOSE), timeout_s=0.5) as r:
        start = time.monotonic()
        with pytest.raises(ReplayTimeoutError, match=f"sample\\(4\\).*table '{TABLE_NAME}': size=0"):
            r.reader.sample(4)
        assert 0.4 < time.monotonic() - start < 3.0


def test_sample_times_out_instead_of_hanging_when_sampled_items_expire():
    # With max_times_sampled, items vanish as they are sampled: the table drops below
    # min_size_to_sample mid-batch, where Reverb's own sampler would block forever.
    # (Config validation rejects this setting in replay mode; the reader must still not hang.)
    cfg = config("train.batch_size=4", "replay.min_size_to_sample=4", "replay.samples_per_insert=1")
    cfg = dataclasses.replace(cfg, replay=dataclasses.replace(cfg.replay, max_times_sampled=1))
    with serve(cfg, timeout_s=0.5) as r:
        r.writer.insert(rollouts(range(4)))
        assert r.state().can_sample(4)
        with pytest.raises(ReplayTimeoutError, match="with 1 of 4 items taken"):
            r.reader.sample(4)


def test_an_insert_the_limiter_admitted_times_out_naming_the_server_not_the_limiter():
    """replay.timeout_s=0.001: the server often cannot confirm 1024 rows that soon, although
    the limiter (unlimited here) admits them all; the message must say so, not blame the
    limiter. A third or so of the attempts time out; 40 make missing one implausible."""
    spec = {"tokens": ((10,), np.int32)}
    unlimited = config(*LOOSE, "replay.error_buffer=1e12")
    with reverb_server(unlimited, spec) as server:
        for _ in range(40):
            writer = RolloutWriter(server, spec, timeout_s=0.001)
            try:
                writer.insert({"tokens": np.zeros((1024, 10), np.int32)})
            except ReplayTimeoutError as e:
                message = str(e)
                break
        else:
            pytest.fail("no insert timed out")
        assert "waiting for the server to confirm them, although the rate limiter admits inserts" in message
        assert "waiting for the rate limiter" not in message
        assert server.states()[TABLE_NAME].can_insert(1)


def test_a_sample_another_client_took_ends_at_once_naming_it():
    """The caller's snapshot admitted 4 samples, but a second client took 2 of them first:
    Reverb's sampler would wait for more inserts forever. The reader sees its sampler
    stalled with the table counting more samples than it received, and says why."""
    cfg = config("train.batch_size=4", "replay.min_size_to_sample=4", "replay.samples_per_insert=1",
                 "replay.error_buffer=4", "replay.max_size=64")
    with serve(cfg, timeout_s=30) as r:
        r.writer.insert(rollouts(range(4)))
        snapshot = r.server.states()
        assert snapshot[TABLE_NAME].can_sample_at_once(4) and not snapshot[TABLE_NAME].can_sample(5)
        RolloutReader(r.server, timeout_s=2).sample(2)  # the other client
        start = time.monotonic()
        with pytest.raises(TableSharedError, match=r"changed by another client .* replay\.port"):
            r.reader.sample(4, snapshot)
        assert time.monotonic() - start < 2


@pytest.mark.parametrize("stage", ["waiting for the limiter", "waiting for Reverb's sampler"])
def test_sigterm_ends_a_wait_within_a_slice(stage):
    """SIGTERM's handler runs during any wait (they come back to Python every slice), and
    the preemption flag it sets ends the wait in ReplayInterrupted: whether the reader polls
    the limiter or waits on a sampler that the limiter holds back inside Reverb."""
    notice = PreemptionNotice()  # this test runs on the main thread
    try:
        with serve(config(*LOOSE), timeout_s=30) as r:
            reader = RolloutReader(r.server, timeout_s=30, interrupted=notice.is_set)
            snapshot = None
            if stage == "waiting for Reverb's sampler":  # a snapshot that wrongly admits 4 samples of 2 items
                r.writer.insert(rollouts(range(2)))
                snapshot = {TABLE_NAME: dataclasses.replace(r.state(), size=4, deletes=-2)}
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
            start = time.monotonic()
            with pytest.raises(ReplayInterrupted):
                reader.sample(4, snapshot)
            assert 0.25 < time.monotonic() - start < 1.0
    finally:
        notice.close()


def test_a_pinned_port_is_claimed_by_one_server_at_a_time():
    """gRPC binds with SO_REUSEPORT, so Reverb alone would start a second server on a
    port in use and split the clients between the two."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with serve(config(*LOOSE), port=port) as r:
        assert r.server.port == port
        with pytest.raises(PortInUseError, match=f"^replay.port: {port} is in use by another jaxreplay run "
                                                 f"\\(pid {os.getpid()}\\)"):
            reverb_server(config(*LOOSE), port=port)
        with pytest.raises(PortInUseError, match=f"replay.port: {port}"):
            check_port(port)
    with serve(config(*LOOSE), port=port) as r:  # free again once the first server stopped
        assert r.server.port == port
    with socket.socket() as other:  # anything listening there, on any interface
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last server's connections linger
        other.bind(("127.0.0.1", port))
        other.listen()
        with pytest.raises(PortInUseError, match=f"replay.port: {port} is already in use"):
            reverb_server(config(*LOOSE), port=port)


def test_reverb_logs_go_to_a_file_not_the_terminal(tmp_path):
    """Reverb's logger writes a line per sampler (per batch) straight to file descriptor 2,
    with no level to set: outside the CLI the adapter moves descriptor 2 to a log file,
    leaving Python's stderr on the terminal."""
    script = (
        "import sys, numpy as np\n"
        "from jaxreplay.config import load_config\n"
        "from jaxreplay.replay.reader import RolloutReader\n"
        "from jaxreplay.replay.server import serve\n"
        "from jaxreplay.replay.tables import build_tables\n"
        "from jaxreplay.replay.writer import RolloutWriter\n"
        "spec = {'tokens': ((3,), np.int32), 'reward': ((), np.float32)}\n"
        "c = load_config(None, ['replay.backend=reverb', 'train.batch_size=2', 'train.prompts_per_step=2',\n"
        "                       'train.group_size=2', 'replay.min_size_to_sample=2', 'replay.max_size=8'])\n"
        "with serve(build_tables(c, spec), timeout_s=5) as s:\n"
        "    RolloutWriter(s, spec, timeout_s=5).insert({'tokens': np.zeros((4, 3), np.int32),\n"
        "                                                'reward': np.zeros(4, np.float32)})\n"
        "    RolloutReader(s, timeout_s=5).sample(2)\n"
        "print('python stderr', file=sys.stderr)\n")
    log = tmp_path / "native.log"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "JAXREPLAY_NATIVE_LOG": str(log)})
    assert result.returncode == 0, result.stderr
    assert "[reverb/cc" not in result.stderr + result.stdout
    assert result.stderr.strip() == "python stderr"
    assert "Sampler and server are owned by the same process" in log.read_text()


# 3. Selectors, eviction, on-policy --------------------------------------------------


@pytest.mark.parametrize("selector, expected_id", [("fifo", 4), ("lifo", 11)])
def test_fifo_lifo_selectors_and_fifo_eviction(selector, expected_id):
    cfg = config("train.batch_size=2", f"replay.selector={selector}", "replay.max_size=8",
                 "replay.min_size_to_sample=4", "replay.error_buffer=1000")
    with serve(cfg) as r:
        r.writer.insert(rollouts(range(12)))  # ids 0..3 are evicted, oldest first
        state = r.state()
        assert (state.size, state.inserts, state.deletes) == (8, 12, 4)
        batch, _ = r.reader.sample(2)
        np.testing.assert_array_equal(batch["policy_version"], [expected_id] * 2)


def test_uniform_samples_only_the_window():
    cfg = config("train.batch_size=2", "replay.max_size=8", "replay.min_size_to_sample=4",
                 "replay.error_buffer=1000")
    with serve(cfg) as r:
        r.writer.insert(rollouts(range(12)))
        batch, _ = r.reader.sample(200)
    assert set(batch["policy_version"]) == set(range(4, 12))


def test_prioritized_selector_samples_by_priority():
    cfg = config(*LOOSE, "replay.selector=prioritized", "replay.priority_exponent=1")
    with serve(cfg) as r:
        r.writer.insert(rollouts(range(4)), priorities=np.array([1.0, 1.0, 1.0, 5.0]))
        batch, info = r.reader.sample(64)
    expected = np.where(batch["policy_version"] == 3, 5 / 8, 1 / 8)
    np.testing.assert_allclose(info.probabilities, expected)


def test_on_policy_trains_on_each_rollout_once_newest_first():
    cfg = config("replay.mode=on_policy", "train.batch_size=4", "train.prompts_per_step=2",
                 "train.group_size=4")  # R = 8 rollouts per step
    with serve(cfg, timeout_s=0.5) as r:
        for step in range(2):
            ids = range(8 * step, 8 * step + 8)
            r.writer.insert(rollouts(ids))
            assert not r.state().can_insert(1)  # the queue holds exactly max(B, R)
            for newest in (ids[-1], ids[-1] - 4):
                batch, info = r.reader.sample(4)
                np.testing.assert_array_equal(batch["policy_version"], np.arange(newest, newest - 4, -1))
                np.testing.assert_array_equal(info.times_sampled, 1)
            assert r.state().size == 0
        with pytest.raises(ReplayTimeoutError):
            r.reader.sample(4)


# 4. Checkpoint and restore ----------------------------------------------------------


def test_restore_gives_back_the_named_checkpoint_even_when_a_newer_one_exists(tmp_path):
    cfg = config(*LOOSE, "replay.samples_per_insert=2")
    root = str(tmp_path / "reverb")
    with serve(cfg, checkpoint_root=root) as r:
        r.writer.insert(rollouts(range(10)))
        r.reader.sample(4)
        path_a, state_a = r.server.checkpoint(), r.state()
        r.writer.insert(rollouts(range(10, 20)))
        r.reader.sample(4)
        path_b, state_b = r.server.checkpoint(), r.state()
    assert not os.path.isabs(path_a) and path_a < path_b  # names relative to the root
    assert os.path.isdir(os.path.join(root, path_a)) and os.path.isdir(os.path.join(root, path_b))

    with reverb_server(cfg, checkpoint_root=root, restore_from=path_a) as server:
        assert server.states()[TABLE_NAME] == state_a  # size, inserts, samples, deletes, window
        # Reverb swapped in the restored table: the object we built is stale, so the
        # server answers from its live counters instead.
        assert server.states()[TABLE_NAME].can_sample(4) and not server.reverb_tables[0].can_sample(4)
        batch, _ = RolloutReader(server, timeout_s=2.0).sample(300)
    assert set(batch["policy_version"]) == set(range(10))
    assert_rows_equal(batch, batch["policy_version"])

    with reverb_server(cfg, checkpoint_root=root, restore_from=path_b) as server:
        assert server.states()[TABLE_NAME] == state_b


def test_restore_refuses_a_missing_or_mismatched_checkpoint(tmp_path):
    cfg = config(*LOOSE)
    root = str(tmp_path)
    with serve(cfg, checkpoint_root=root) as r:
        r.writer.insert(rollouts(range(4)))
        path = r.server.checkpoint()
    with pytest.raises(DamagedCheckpoint, match="no complete Reverb checkpoint"):  # Reverb itself would start empty
        reverb_server(cfg, checkpoint_root=root, restore_from=path + "-nope")
    other = config(*LOOSE, "replay.samples_per_insert=3")
    with pytest.raises(ValueError, match="samples_per_insert: checkpoint 2.0 vs config 3.0"):
        reverb_server(other, checkpoint_root=root, restore_from=path)
    # Same bytes per row, other fields: rows would be misread, so the layout is part of the signature.
    same_size = {**SPEC, "logprobs": ((T,), np.int32)}
    with pytest.raises(ValueError, match="signature: checkpoint .*logprobs:<f4.* vs config .*logprobs:<i4"):
        reverb_server(cfg, same_size, checkpoint_root=root, restore_from=path)


def cut_short(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def one_byte_changed(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage, named", [
    (lambda d: cut_short(os.path.join(d, "chunks.tfrecord")), "chunks.tfrecord: its sha256"),
    (lambda d: one_byte_changed(os.path.join(d, "items.tfrecord")), "items.tfrecord: its sha256"),
    (lambda d: os.remove(os.path.join(d, "tables.tfrecord")), "tables.tfrecord: missing"),
    (lambda d: os.remove(os.path.join(d, "DONE")), "DONE: missing"),
    (lambda d: cut_short(os.path.join(d, "sha256.json")), "sha256.json: not a JSON object"),
], ids=["chunks cut short", "items changed", "tables missing", "DONE missing", "hashes cut short"])
def test_a_checkpoint_whose_files_changed_since_it_was_written_is_named_before_reverb_reads_it(tmp_path, damage,
                                                                                                 named):
    cfg = config(*LOOSE)
    with serve(cfg, checkpoint_root=str(tmp_path)) as r:
        r.writer.insert(rollouts(range(4)))
        path = os.path.join(tmp_path, r.server.checkpoint())
    verify(path)  # as written
    damage(path)
    with pytest.raises(DamagedCheckpoint, match=named):
        verify(path)


def test_a_checkpoint_from_before_the_hashes_is_checked_for_its_done_marker_only_and_restores(tmp_path):
    cfg = config(*LOOSE)
    with serve(cfg, checkpoint_root=str(tmp_path)) as r:
        r.writer.insert(rollouts(range(4)))
        name = r.server.checkpoint()
    os.remove(os.path.join(tmp_path, name, "sha256.json"))
    verify(os.path.join(tmp_path, name))
    with serve(cfg, checkpoint_root=str(tmp_path), restore_from=name) as r:
        assert r.server.states()[TABLE_NAME].size == 4


# 5. build_tables agrees with config validation ----------------------------------------


def random_run(r: Replay, batch_size: int, steps: int, seed: int):
    """Random possible moves (insert 1 / sample batch_size) until none is possible.

    Returns the stuck state (or None) and which single moves were ever blocked.
    Checks at every step that `LimiterState` answers exactly as Reverb's table does.
    """
    rng, next_id, blocked = random.Random(seed), 0, set()
    spi = r.state().samples_per_insert
    p_insert = batch_size / (batch_size + spi)  # no drift: both window edges get visited
    for _ in range(steps):
        state = r.state()
        can_insert, can_sample = state.can_insert(1), state.can_sample(batch_size)
        assert (can_insert, can_sample) == (r.table.can_insert(1), r.table.can_sample(batch_size))
        moves = [m for m, ok in (("insert", can_insert), ("sample", can_sample)) if ok]
        blocked |= {"insert", "sample"} - set(moves)
        if not moves:
            return state, blocked
        if moves == ["insert"] or (len(moves) == 2 and rng.random() < p_insert):
            r.writer.insert(rollouts([next_id]))
            next_id += 1
        else:
            r.reader.sample(batch_size)
    return None, blocked


def limiter_config(batch_size, spi, error_buffer, *extra):
    eb = [] if error_buffer is None else [f"replay.error_buffer={error_buffer}"]
    return config(f"train.batch_size={batch_size}", f"replay.samples_per_insert={spi}",
                  "replay.min_size_to_sample=12", "replay.max_size=24", *eb, *extra)


@pytest.mark.parametrize("batch_size, spi, error_buffer, extra", [
    (8, 2.0, 5.0, ()),  # 2 * error_buffer == batch_size + spi: the boundary itself
    (8, 1.0, 4.5, ()),
    (6, 0.5, 3.25, ()),
    (4, 3.0, 3.5, ()),
    (8, 2.0, None, ()),  # the default error buffer
    (4, 2.0, None, ("replay.mode=on_policy", "train.prompts_per_step=2", "train.group_size=4")),
])
def test_validated_configs_never_stall_the_limiter(batch_size, spi, error_buffer, extra):
    cfg = limiter_config(batch_size, spi, error_buffer, *extra)
    with serve(cfg) as r:
        stuck, blocked = random_run(r, batch_size, steps=600, seed=batch_size)
        assert stuck is None, stuck.describe()
        assert blocked == {"insert", "sample"}  # the walk pressed both edges of the window
        assert r.state().deletes > 0  # and the FIFO window slid


@pytest.mark.parametrize("batch_size, spi, error_buffer", [
    # Below the rule. The rule is tight to within one step of the lattice of
    # reachable diffs (inserts * spi - samples): (8, 2.0, 4.0) cannot stall, as
    # every diff is even there.
    (8, 2.0, 3.0),
    (8, 1.0, 3.5),
    (6, 0.5, 2.75),
])
def test_configs_below_the_rule_do_stall(batch_size, spi, error_buffer):
    ok = limiter_config(batch_size, spi, None)
    cfg = dataclasses.replace(ok, replay=dataclasses.replace(ok.replay, error_buffer=error_buffer))
    with pytest.raises(ConfigError, match="replay.error_buffer"):
        validate(cfg)
    with serve(cfg, timeout_s=0.3) as r:
        stuck, _ = random_run(r, batch_size, steps=600, seed=0)
        assert stuck is not None, "expected the limiter to stall"
        # Stuck for real: both calls time out rather than hang.
        with pytest.raises(ReplayTimeoutError):
            r.reader.sample(batch_size)
        with pytest.raises(ReplayTimeoutError):
            r.writer.insert(rollouts([10_000]))
