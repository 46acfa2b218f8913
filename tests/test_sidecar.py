"""Reverb through its sidecar process on the default tier: the wire, and every way it can fail.

The wire tests need no sidecar; the rest start a real one (dm-reverb 0.14.0 under the
Python of `make venv-sidecar`) and skip where none is found (needs_sidecar).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config
from jaxreplay.replay import wire
from jaxreplay.replay.ports import _listening
from jaxreplay.replay.reader import RolloutReader
from jaxreplay.replay.rows import RowLayout
from jaxreplay.replay.sidecar import SidecarError, SidecarServer, find_python
from jaxreplay.replay.sidecar_main import Sidecar, message_limits, row_limit, serve_connection
from jaxreplay.replay.tables import ReplayInterrupted, ReplayTimeoutError, build_tables
from jaxreplay.replay.writer import RolloutWriter
from replay_rows import SPEC, rollouts

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["train.batch_size=4", "train.prompts_per_step=2", "train.group_size=2", "replay.max_size=10",
         "replay.min_size_to_sample=4", "replay.backend=reverb"]

pytestmark = pytest.mark.timeout(300, method="thread")


def tables(*overrides: str):
    return build_tables(load_config(None, [*SMALL, *overrides], local=False), SPEC, "reverb")


def _pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


# --- the wire -------------------------------------------------------------------------

def test_arrays_cross_as_their_own_bytes_dtype_and_shape():
    a, b = _pair()
    with a, b:
        arrays = {"tokens": np.arange(12, dtype=np.int32).reshape(3, 4), "mask": np.array([True, False]),
                  "keys": np.array([2**64 - 1], np.uint64), "empty": np.zeros((0, 5), np.float32)}
        wire.send(a, {"op": "x", "n": 3}, arrays)
        header, got = wire.recv(b, time.monotonic() + 5)
    assert header == {"op": "x", "n": 3}
    assert set(got) == set(arrays)
    for k, v in arrays.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape
        np.testing.assert_array_equal(got[k], v)


def test_objects_never_cross_the_wire():
    """No pickles: an object array is refused when sent, and a header naming one when read."""
    with pytest.raises(TypeError, match="only numeric and bool"):
        wire.encode({}, {"x": np.array([object()])})
    a, b = _pair()
    with a, b:
        head = json.dumps({"arrays": [["x", "|O", [1]]]}).encode()
        a.sendall(wire._PREFIX.pack(len(head), 8) + head + b"\0" * 8)
        with pytest.raises(wire.WireError, match="only numeric and bool"):
            wire.recv(b, time.monotonic() + 5)


def test_a_peer_that_closes_or_stays_silent_ends_the_read():
    a, b = _pair()
    with b:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            wire.recv(b, time.monotonic() + 0.3)
        assert time.monotonic() - start < 2
        a.close()
        with pytest.raises(wire.WireError, match="closed"):
            wire.recv(b, time.monotonic() + 5)


def test_a_message_declaring_more_than_its_limit_is_refused_before_anything_is_allocated():
    a, b = _pair()
    with a, b:
        a.sendall(wire._PREFIX.pack(10, 2**31 - 1))  # 2 GiB declared, never sent
        with pytest.raises(wire.TooLarge, match=r"past this connection's limit of 65536 \+ 0"):
            wire.recv(b, time.monotonic() + 5, limits=(wire.CONTROL_BYTES, 0))


def _refused(sidecar: Sidecar, declared: tuple[int, int], capfd) -> str:
    """What `sidecar` answers a message declaring `declared` bytes on a connection of its own;
    that the connection is closed after it, and that it said so in one line."""
    theirs, ours = _pair()
    with theirs, ours:
        serving = threading.Thread(target=serve_connection, args=(sidecar, theirs, False), daemon=True)
        serving.start()
        ours.sendall(wire._PREFIX.pack(*declared))
        header, _ = wire.recv(ours, time.monotonic() + 5)
        with pytest.raises(wire.WireError, match="closed"):
            wire.recv(ours, time.monotonic() + 5)
        serving.join(timeout=5)
    lines = [line for line in capfd.readouterr().err.splitlines() if "refused" in line]
    assert len(lines) == 1 and lines[0].startswith("jaxreplay sidecar: refused a message of"), lines
    assert header["ok"] is False and header["error"] == "MessageTooLarge"
    return header["message"]


def test_before_serve_the_sidecar_reads_control_messages_alone(capfd):
    """Until `serve` gives the row layout, a message may hold a small header and no arrays."""
    sidecar = Sidecar()
    assert "limit of 65536 + 0" in _refused(sidecar, (100, 1), capfd)
    assert "limit of 65536 + 0" in _refused(sidecar, (wire.CONTROL_BYTES + 1, 0), capfd)
    assert not sidecar.done.is_set()  # another connection's refusal leaves the sidecar serving


def test_the_row_layout_bounds_a_message_at_the_rows_the_tables_hold():
    defs = tables().defs
    header, payload = message_limits(defs, RowLayout(SPEC))
    assert row_limit(defs) == sum(d.max_size for d in defs) == 10
    assert header == wire.CONTROL_BYTES
    assert payload == 10 * (RowLayout(SPEC).nbytes + 8 + len(defs))  # rows, their priorities, a mask per table


def test_an_interpreter_without_reverb_is_refused_in_one_line_saying_what_to_install():
    with pytest.raises(ConfigError, match=r"make venv-sidecar.*uv python install 3\.11"):
        find_python(sys.executable)  # Python 3.12+: no dm-reverb


def test_the_cli_refuses_a_sidecar_that_cannot_start_before_writing_anything(tmp_path):
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "train", "configs/demo.yaml",
                             "replay.backend=reverb", f"replay.reverb_python={sys.executable}", f"run.dir={run_dir}"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("jaxreplay: config error: replay.reverb_python:"), lines
    assert "make venv-sidecar" in lines[0] and "uv python install 3.11" in lines[0]
    assert not run_dir.exists()


# --- a real sidecar -------------------------------------------------------------------

@pytest.mark.needs_sidecar
def test_the_socket_is_private_and_the_sidecar_serves_reverbs_own_table(tmp_path):
    with SidecarServer(tables(), checkpoint_root=tmp_path, timeout_s=5) as server:
        mode = os.stat(server._socket).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
        assert stat.S_IMODE(os.stat(server._dir).st_mode) == 0o700
        RolloutWriter(server, SPEC, timeout_s=5).insert(rollouts(range(6)))
        batch, info = RolloutReader(server, timeout_s=5).sample(4)
        assert set(batch["policy_version"]) <= set(range(6)) and info.keys.dtype == np.uint64
        for k, (shape, dtype) in SPEC.items():
            assert batch[k].shape == (4, *shape) and batch[k].dtype == dtype
        np.testing.assert_array_equal(batch["tokens"], rollouts(batch["policy_version"])["tokens"])
        name = server.checkpoint()
        assert (tmp_path / name / "DONE").exists()  # Reverb's own checkpoint, under the root
    with SidecarServer(tables(), checkpoint_root=tmp_path, restore_from=name, timeout_s=5) as server:
        state = server.states()[server.table]
        assert (state.size, state.inserts, state.samples) == (6, 6, 4)


@pytest.mark.needs_sidecar
def test_a_sample_the_trainer_interrupts_ends_in_replay_interrupted_and_the_sidecar_serves_on():
    with SidecarServer(tables(), timeout_s=30) as server:
        stop = threading.Event()
        threading.Timer(0.5, stop.set).start()
        start = time.monotonic()
        with pytest.raises(ReplayInterrupted):
            server.sample(server.table, 4, timeout_s=30, interrupted=stop.is_set)  # empty: the limiter holds it
        assert time.monotonic() - start < 5
        RolloutWriter(server, SPEC, timeout_s=5).insert(rollouts(range(4)))
        assert server.states()[server.table].inserts == 4


@pytest.mark.needs_sidecar
def test_a_call_into_an_empty_table_times_out_in_the_sidecar_with_reverbs_words():
    with SidecarServer(tables(), timeout_s=5) as server:
        with pytest.raises(ReplayTimeoutError, match="waiting for the rate limiter"):
            server.sample(server.table, 4, timeout_s=0.5)


@pytest.mark.needs_sidecar
def test_a_killed_sidecar_ends_the_next_call_in_an_error_naming_it():
    server = SidecarServer(tables(), timeout_s=30)
    try:
        os.kill(server.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(SidecarError, match=rf"Reverb sidecar \(pid {server.pid}.*signal SIGKILL"):
            server.sample(server.table, 4, timeout_s=30)
        assert time.monotonic() - start < 10
    finally:
        server.stop()


@pytest.mark.needs_sidecar
def test_a_message_past_the_row_layout_is_refused_on_its_connection_and_the_sidecar_serves_on(tmp_path):
    """The largest message the layout allows: the rows all tables hold. A larger insert is sent in parts."""
    wide = ("replay.error_buffer=40",)  # the limiter admits more rows than the table holds, unsampled
    with SidecarServer(tables(*wide), timeout_s=5) as server:
        header, payload = message_limits(tables().defs, RowLayout(SPEC))
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(server._socket)
            raw.sendall(wire._PREFIX.pack(10, payload + 1))
            reply, _ = wire.recv(raw, time.monotonic() + 5)
            assert reply["ok"] is False and reply["error"] == "MessageTooLarge"
            assert f"limit of {header} + {payload}" in reply["message"]
            with pytest.raises(wire.WireError, match="closed"):
                wire.recv(raw, time.monotonic() + 5)
        RolloutWriter(server, SPEC, timeout_s=5).insert(rollouts(range(row_limit(tables().defs) + 3)))
        state = server.states()[server.table]
        assert (state.inserts, state.size) == (13, 10)


@pytest.mark.needs_sidecar
def test_a_hung_sidecar_is_said_once_overdue_then_killed_at_the_timeout_not_asked_to_stop(capfd):
    server = SidecarServer(tables(), timeout_s=1)
    private = server._dir
    os.kill(server.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        with pytest.raises(ReplayTimeoutError, match=r"did not answer states within 6s \(hung\?\); it was killed"):
            server.states()
        assert time.monotonic() - start < 1 + 6
        assert server._proc.poll() == -signal.SIGKILL  # at once: a stop call would wait on it again
        start = time.monotonic()
        server.stop()
        assert time.monotonic() - start < 1
    finally:
        if server._proc.poll() is None:
            os.kill(server.pid, signal.SIGCONT)
        server.stop()
    said = [line for line in capfd.readouterr().err.splitlines() if "has not answered" in line]
    assert len(said) == 1, said
    assert said[0].startswith(f"warning: the Reverb sidecar (pid {server.pid}) has not answered states "
                              "within its 1s; waiting ")
    assert said[0].endswith("then it is killed as hung")
    assert not os.path.exists(private)


HOLDER = """
import sys, time
sys.path.insert(0, "tests")
from jaxreplay.config import load_config
from jaxreplay.replay.sidecar import SidecarServer
from jaxreplay.replay.tables import build_tables
from replay_rows import SPEC
server = SidecarServer(build_tables(load_config(None, sys.argv[1:], local=False), SPEC, "reverb"), port={port})
print(server.pid, server.port, server._socket, flush=True)
time.sleep(600)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@pytest.mark.needs_sidecar
def test_a_trainer_killed_with_sigkill_leaves_no_sidecar_socket_or_port():
    port = _free_port()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.replace("{port}", str(port)), *SMALL], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    try:
        pid, served, path = holder.stdout.readline().split()
        assert int(served) == port and _listening(port)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    deadline = time.monotonic() + 15
    while _alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(int(pid)), "the sidecar outlived its trainer"
    assert not _listening(port) and not os.path.exists(path)
    assert not os.path.exists(os.path.dirname(path))  # its private directory: the sidecar removed it


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# --- a run through the sidecar --------------------------------------------------------

def _sidecar_of(pid: int) -> int:
    """The pid of the sidecar process `pid` started."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat_line = Path(f"/proc/{entry}/stat").read_text()
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat_line.split(")")[-1].split()[1]) == pid and b"jaxreplay.replay.sidecar_main" in cmdline:
                return int(entry)
    raise AssertionError(f"process {pid} has no sidecar")


def _private_dir(sidecar: int) -> str:
    """The private directory of sidecar process `sidecar` (its socket's; sidecar_main's first argument)."""
    argv = Path(f"/proc/{sidecar}/cmdline").read_bytes().split(b"\0")
    return os.path.dirname(argv[argv.index(b"jaxreplay.replay.sidecar_main") + 1].decode())


def _gone(pid: int, within_s: float = 15) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


@pytest.mark.needs_sidecar
@pytest.mark.slow
@pytest.mark.timeout(1200, method="thread")
def test_a_run_through_the_sidecar_survives_its_sidecar_killed_its_trainer_killed_and_sigterm(tmp_path):
    """The colocated loop on Reverb through the sidecar. Its sidecar SIGKILLed: the run ends in one
    line naming it, exit 2. Its trainer SIGKILLed: the sidecar goes too, with its private directory.
    SIGTERM to the trainer and its sidecar at once, as a preempted VM, `systemctl stop` or Slurm's
    `scancel` send it (the sidecar has a session of its own, so the trainer's process group is not
    enough), in training and again in the final save: a final checkpoint at the last logged step
    through the sidecar, exit 143, no process left. Each time the same command resumes from the
    last checkpoint, and the finished run records each step once and has sampled exactly steps x
    batch rows (FIFO batches: Reverb's other selectors are not seeded)."""
    from test_crash import STEPS, checkpoint_steps, cli, logged_step, wait_for_step
    from test_signals import Command
    from jaxreplay.train.metrics import read_metrics

    run_dir = tmp_path / "run"
    command = cli(run_dir, "replay.backend=reverb")

    def leg(target: int):
        proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for_step(proc, run_dir, max(target, logged_step(run_dir) + 2), timeout_s=400)
        return proc, _sidecar_of(proc.pid)

    proc, sidecar = leg(4)
    os.kill(sidecar, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.strip().splitlines()[-1].startswith(f"jaxreplay: error: the Reverb sidecar (pid {sidecar}"), err
    assert "signal SIGKILL" in err.strip().splitlines()[-1]
    first = max(checkpoint_steps(run_dir))

    proc, sidecar = leg(first + 3)  # resumed and trained past it
    private = _private_dir(sidecar)
    proc.kill()
    proc.wait(timeout=60)
    assert _gone(sidecar), "the sidecar outlived its SIGKILLed trainer"
    assert not os.path.exists(private)

    proc, sidecar = leg(max(checkpoint_steps(run_dir)) + 3)  # in training
    private = _private_dir(sidecar)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(sidecar, signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 143, err
    assert max(checkpoint_steps(run_dir)) == logged_step(run_dir)  # the final checkpoint, through the sidecar
    assert _gone(sidecar) and not os.path.exists(private)

    saved = max(checkpoint_steps(run_dir))  # in the final save: none falls due before it
    saving = Command([*command, "checkpoint.every=1000"])
    assert saving.wait_for_line("resumed from step ") == f"resumed from step {saved} (policy version {saved})\n"
    wait_for_step(saving.proc, run_dir, saved + 3, timeout_s=400)
    sidecar = _sidecar_of(saving.proc.pid)
    saving.proc.send_signal(signal.SIGTERM)
    saving.wait_for_line("SIGTERM: saving a checkpoint at step ")
    os.kill(sidecar, signal.SIGTERM)
    saving.proc.send_signal(signal.SIGTERM)
    status, _, err = saving.finish(timeout_s=180)
    assert status == 143, err
    assert max(checkpoint_steps(run_dir)) == logged_step(run_dir) > saved
    assert _gone(sidecar)

    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "replay backend: reverb" in result.stdout + result.stderr
    assert "dm-reverb 0.14.0 in a sidecar process" in result.stdout + result.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(STEPS + 1))  # each step once, in order
    summary = json.loads((run_dir / "summary.json").read_text())
    config = load_config(run_dir / "config.yaml")
    assert summary["replay/backend"] == "reverb"
    assert summary["replay/samples"] == STEPS * config.train.batch_size


@pytest.mark.needs_sidecar
@pytest.mark.slow
def test_a_run_whose_sidecar_hangs_says_so_once_overdue_and_ends_at_its_timeout(tmp_path):
    """A SIGSTOPped sidecar: one warning line once a call is overdue, then the run ends in one
    error line within the call's bound, the sidecar killed rather than asked to stop and waited on."""
    from test_crash import cli, wait_for_step

    timeout_s = 3
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(cli(run_dir, "replay.backend=reverb", f"replay.timeout_s={timeout_s}"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(proc, run_dir, 2, timeout_s=400)
        sidecar = _sidecar_of(proc.pid)
        private = _private_dir(sidecar)
        os.kill(sidecar, signal.SIGSTOP)
        start = time.monotonic()
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]  # a replay timeout's status
    assert took < timeout_s + 5 + 10, took  # the call's bound, and a few seconds to end; no polite stop
    said = [line for line in err.splitlines() if "has not answered" in line]
    assert len(said) == 1 and said[0].startswith(f"warning: the Reverb sidecar (pid {sidecar}) has not answered "), err
    assert f"within its {timeout_s}s; waiting " in said[0] and "warning" not in out
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"jaxreplay: error: the Reverb sidecar (pid {sidecar}) did not answer "), err[-3000:]
    assert last.endswith("(hung?); it was killed")
    assert _gone(sidecar) and not os.path.exists(private)


def _tcp_listeners(pid: int) -> list[str]:
    """The TCP ports process `pid` listens on (its socket fds' inodes in /proc/net/tcp{,6}, state LISTEN)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if os.path.exists(table):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    ports.append(str(int(fields[1].rsplit(":", 1)[1], 16)))
    return ports


@pytest.mark.needs_sidecar
def test_a_client_sidecar_reaches_another_sidecars_reverb_table_and_listens_on_no_port():
    """A multi-host job's other processes (CentralReplay): a sidecar holding only a Reverb client
    to process 0's port. Rows it inserts land in that table, its samples come from it, and its
    only listener is its private Unix socket."""
    with SidecarServer(tables(), timeout_s=5) as central:
        with SidecarServer(tables(), timeout_s=5, connect=f"localhost:{central.port}") as client:
            assert client.port is None and client.table == central.table
            mode = os.stat(client._socket).st_mode
            assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
            assert _tcp_listeners(client.pid) == []
            assert str(central.port) in _tcp_listeners(central.pid)  # Reverb's own port, process 0's alone
            RolloutWriter(client, SPEC, timeout_s=5).insert(rollouts(range(6)))
            state = central.states()[central.table]
            assert (state.size, state.inserts) == (6, 6)  # in process 0's table
            batch, info = RolloutReader(client, timeout_s=5).sample(4)
            np.testing.assert_array_equal(batch["tokens"], rollouts(batch["policy_version"])["tokens"])
            assert client.states()[client.table].samples == central.states()[central.table].samples == 4
            pid = client.pid
        assert not _alive(pid)  # closing the client ends its sidecar
        RolloutWriter(central, SPEC, timeout_s=5).insert(rollouts(range(6, 8)))  # the server serves on
        assert central.states()[central.table].size == 8


@pytest.mark.needs_sidecar
def test_a_multi_host_job_on_reverb_through_the_sidecar_passes_validation():
    if importlib.util.find_spec("reverb") is not None:
        pytest.skip("Reverb is importable here: the processes hold it in process (the Reverb lane)")
    config = load_config(None, ["replay.backend=reverb", "distributed.enabled=true", "distributed.num_processes=2",
                                "distributed.process_id=1", "distributed.coordinator_address=127.0.0.1:1234"])
    assert config.replay.backend == "reverb"
