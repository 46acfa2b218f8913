"""Stop signals, as a user and a preempted VM send them: SIGTERM ends a run with a final
checkpoint and exit 143, Ctrl-C (SIGINT) the same with exit 130, at every stage.

Real `jaxreplay` processes and real signals. Each test waits for what marks the stage
(a line the run prints, a step in metrics.jsonl), then signals; what it asserts holds
wherever in that stage the signal lands.
"""

from __future__ import annotations

import functools
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml


from test_crash import assert_every_checkpoint_restores, checkpoint_steps, cli, logged_step, wait_for_step
from test_resume import _finish, _job, needs_multiprocess_checkpoints, resumed_from
from test_train import DEMO, ROOT, TINY

TIMEOUT_S = 240


def _cli(run_dir, *overrides: str, backend: str) -> list[str]:
    return cli(run_dir, *overrides, f"replay.backend={backend}")

SIGINT_LINE = "jaxreplay: interrupted: SIGINT (Ctrl-C)"


class Command:
    """A running command whose stdout and stderr are read as they come (lines, and stderr's
    progress bars, which end in carriage returns)."""

    def __init__(self, args: list[str], **kwargs):
        self.proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     **kwargs)
        self._lines: queue.Queue[str] = queue.Queue()
        self.stdout: list[str] = []
        self._stderr: list[str] = []
        threading.Thread(target=self._read, args=(self.proc.stdout, self._lines.put), daemon=True).start()
        self._err = threading.Thread(target=self._read, args=(self.proc.stderr, self._stderr.append, 1), daemon=True)
        self._err.start()

    @staticmethod
    def _read(stream, put, chunk: int = 0) -> None:
        for piece in iter(lambda: stream.read(chunk) if chunk else stream.readline(), ""):
            put(piece)

    def wait_for_line(self, start: str, timeout_s: float = TIMEOUT_S) -> str:
        """The first stdout line starting with `start`, once it is printed."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=0.05)
            except queue.Empty:
                assert self.proc.poll() is None or not self._lines.empty(), \
                    f"the command ended (rc {self.proc.returncode}) before printing {start!r}: {self.stderr[-2000:]}"
                assert time.monotonic() < deadline, f"no line {start!r} within {timeout_s}s"
                continue
            self.stdout.append(line)
            if line.startswith(start):
                return line

    def wait_for_stderr(self, text: str, timeout_s: float = TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.stderr:
            assert self.proc.poll() is None, f"the command ended (rc {self.proc.returncode}) before {text!r}"
            assert time.monotonic() < deadline, f"no {text!r} on stderr within {timeout_s}s"
            time.sleep(0.05)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    def finish(self, timeout_s: float = TIMEOUT_S) -> tuple[int, str, str]:
        """(exit status, stdout, stderr) once the command ended."""
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self._err.join(timeout=10)
        while not self._lines.empty():
            self.stdout.append(self._lines.get())
        return self.proc.returncode, "".join(self.stdout), self.stderr


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def assert_one_line(stderr: str, start: str) -> None:
    """The command ended with one `jaxreplay:` line, starting with `start`, and no traceback."""
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]
    assert [line for line in stderr.splitlines() if line.startswith("jaxreplay: ")] == [last_line(stderr)], stderr
    assert last_line(stderr).startswith(start), stderr[-2000:]


# -- the pod configs -----------------------------------------------------------------------------

POD_CONFIGS = sorted((ROOT / "configs").glob("pod_*.yaml"))


@pytest.mark.parametrize("path", POD_CONFIGS, ids=lambda p: p.stem)
def test_pod_configs_checkpoint_by_the_clock_and_leave_the_job_layout_to_jax(path):
    """A preempted spot slice loses at most `checkpoint.every_seconds` of work; the coordinator
    and the process layout come from the TPU VM's metadata (JAX's auto-detection). Read as written:
    the GSM8K recipe's configs take model.hf_path and task.path on the command line, and
    pod_tiny_cpu is their one-process CPU twin."""
    raw = yaml.safe_load(path.read_text())
    assert raw["checkpoint"]["every_seconds"] > 0
    d = raw.get("distributed", {})
    assert not {"coordinator_address", "replay_address", "num_processes", "process_id"} & d.keys(), d
    assert d.get("enabled") is (path.stem != "pod_tiny_cpu")


# -- the notice itself, in a bare process ---------------------------------------------------------

NOTICE = """
import os, signal, sys, time
from jaxreplay.train.guards import PreemptionNotice, pending
notice = PreemptionNotice.for_process()
for s in sys.argv[1:]:
    os.kill(os.getpid(), getattr(signal, s))
    time.sleep(0.2)
print(pending().name if pending() else None, flush=True)
"""


@pytest.mark.parametrize("signals, status, printed", [
    (["SIGTERM", "SIGTERM", "SIGTERM"], 0, "SIGTERM"),  # later SIGTERMs change nothing
    (["SIGINT"], 0, "SIGINT"),
    (["SIGINT", "SIGINT"], 130, ""),  # a second Ctrl-C aborts at once
    (["SIGTERM", "SIGINT"], 130, ""),
])
def test_the_notice_flags_stop_signals_and_a_second_ctrl_c_aborts(signals, status, printed):
    result = subprocess.run([sys.executable, "-c", NOTICE, *signals], cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout.strip()) == (status, printed), result.stderr
    if status:
        assert_one_line(result.stderr, "jaxreplay: interrupted: Ctrl-C again after")


NATIVE = """
import hashlib, os, signal, threading
from jaxreplay.train.guards import PreemptionNotice
PreemptionNotice.for_process()
os.kill(os.getpid(), signal.SIGINT)
threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
# One native call of many minutes that releases the GIL, as an XLA compile does: no bytecode runs,
# so no Python handler either, until it returns.
print(hashlib.pbkdf2_hmac("sha256", b"key", b"salt", 10 ** 9).hex(), flush=True)
"""


def test_a_second_ctrl_c_aborts_even_while_the_main_thread_is_in_one_long_native_call():
    result = subprocess.run([sys.executable, "-c", NATIVE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stdout) == (130, ""), result.stderr
    assert_one_line(result.stderr, "jaxreplay: interrupted: Ctrl-C again after SIGINT (Ctrl-C)")


# -- each stage of a run --------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_during_the_warm_start_exits_130_with_nothing_half_written(tmp_path):
    run = tmp_path / "run"
    command = Command(cli(run, "warmstart.steps=20000"))
    command.wait_for_line("colocated: ")  # the placement is said just before the policy is built
    command.proc.send_signal(signal.SIGINT)
    status, _, stderr = command.finish()
    assert status == 130, stderr[-2000:]
    assert_one_line(stderr, f"{SIGINT_LINE} during the warm start (step ")
    assert "no checkpoint" in last_line(stderr) and "starts over" in last_line(stderr)
    assert checkpoint_steps(run) == []
    cache = tmp_path / ".warmstart-cache"
    assert not cache.exists() or list(cache.iterdir()) == []  # no entry, whole or partial


@pytest.mark.slow
def test_ctrl_c_during_the_start_up_evaluation_exits_130_and_the_rerun_keeps_the_warm_start(tmp_path):
    """It was swallowed in 2 of 3 runs (a KeyboardInterrupt inside XLA's gc callback), and the
    run went on to finish with status 0."""
    run = tmp_path / "run"
    args = cli(run, "task.max_digits=2", "task.eval_size=2048", "train.steps=2")
    command = Command(args)
    command.wait_for_line("warm start trained for ")  # the start-up evaluation comes next
    command.proc.send_signal(signal.SIGINT)
    status, stdout, stderr = command.finish()
    assert status == 130, stderr[-2000:]
    assert_one_line(stderr, f"{SIGINT_LINE} during the start-up evaluation: no learner step ran")
    assert "eval/accuracy at start" not in stdout
    assert checkpoint_steps(run) == []
    rerun = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "warm start loaded from cache" in rerun.stdout


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inprocess", pytest.param("reverb", marks=pytest.mark.reverb)])
def test_ctrl_c_in_training_and_in_the_final_save_each_leave_a_checkpoint_the_same_command_resumes(tmp_path, backend):
    """Ctrl-C as a terminal sends it, to the run's whole process group. On the default tier Reverb
    runs in a sidecar process, which keeps serving the final save."""
    run = tmp_path / "run"
    cli = functools.partial(_cli, backend=backend)
    command = Command(cli(run, "checkpoint.every=1000"), start_new_session=True)
    wait_for_step(command.proc, run, 3)
    os.killpg(command.proc.pid, signal.SIGINT)
    status, stdout, stderr = command.finish()
    assert status == 130, stderr[-2000:]
    step = logged_step(run)
    assert_one_line(stderr, f"{SIGINT_LINE}: checkpoint at step {step} in ")
    assert f"SIGINT (Ctrl-C): saving a checkpoint at step {step} (Ctrl-C again aborts without it)" in stdout
    assert assert_every_checkpoint_restores(run) == [step]

    # The resumed run ends at step + 2: Ctrl-C once its last step is recorded, while it saves.
    command = Command(cli(run, "checkpoint.every=1000", f"train.steps={step + 2}"), start_new_session=True)
    assert command.wait_for_line("resumed from step ") == f"resumed from step {step} (policy version {step})\n"
    wait_for_step(command.proc, run, step + 2)
    os.killpg(command.proc.pid, signal.SIGINT)
    status, _, stderr = command.finish()
    assert status == 130, stderr[-2000:]
    assert_one_line(stderr, SIGINT_LINE)
    assert f"step {step + 2} in " in last_line(stderr)
    assert assert_every_checkpoint_restores(run) == [step, step + 2]

    rerun = subprocess.run(cli(run, "checkpoint.every=1000", f"train.steps={step + 3}"), cwd=ROOT,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert resumed_from(rerun.stdout) == step + 2


@pytest.mark.slow
def test_more_sigterms_during_the_final_save_wait_for_it_and_the_status_stays_143(tmp_path):
    """The second SIGTERM used to find the signal's default action back in place once the run
    closed, and killed the process (status -15) in 1 of 3 runs."""
    run = tmp_path / "run"
    command = Command(cli(run, "checkpoint.every=1000"))
    wait_for_step(command.proc, run, 3)
    command.proc.send_signal(signal.SIGTERM)
    while command.proc.poll() is None:  # a SIGTERM every 10 ms until the process is gone
        command.proc.send_signal(signal.SIGTERM)
        time.sleep(0.01)
    status, stdout, stderr = command.finish()
    assert status == 128 + signal.SIGTERM, stderr[-2000:]
    step = logged_step(run)
    assert_one_line(stderr, f"jaxreplay: stopped: SIGTERM: checkpoint at step {step} in ")
    assert f"SIGTERM: saving a checkpoint at step {step} (a second SIGTERM waits for it)" in stdout
    assert assert_every_checkpoint_restores(run) == [step]


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_final_save_aborts_at_once_with_130(tmp_path):
    run = tmp_path / "run"
    command = Command(cli(run, "checkpoint.every=1000"))
    wait_for_step(command.proc, run, 3)
    command.proc.send_signal(signal.SIGINT)
    command.wait_for_line("SIGINT (Ctrl-C): saving a checkpoint at step ")
    command.proc.send_signal(signal.SIGINT)
    status, _, stderr = command.finish()
    assert status == 130, stderr[-2000:]
    assert_one_line(stderr, "jaxreplay: interrupted: Ctrl-C again after SIGINT (Ctrl-C): aborted without waiting")
    assert len(assert_every_checkpoint_restores(run)) <= 1  # the save that was cut off is never listed


@pytest.mark.slow
@needs_multiprocess_checkpoints
def test_ctrl_c_to_one_process_of_a_job_stops_every_process_with_130_and_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    procs = _job(run, "train.steps=400", "checkpoint.every=1000")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while logged_step(run) < 3:
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGINT)
    finally:
        results = _finish(procs, TIMEOUT_S)
    assert [rc for rc, _ in results] == [130, 130], [out[-2000:] for _, out in results]
    for i, (_, out) in enumerate(results):
        assert f"jaxreplay: interrupted: process {i}: SIGINT (Ctrl-C): checkpoint at step " in out, out[-2000:]
    step = checkpoint_steps(run)[-1]
    assert step >= 3 and step == logged_step(run)


# -- jaxreplay eval --------------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_during_eval_exits_130_and_writes_no_results(tmp_path):
    run, out = tmp_path / "run", tmp_path / "eval" / "results.json"
    subprocess.run(cli(run, "train.steps=2"), cwd=ROOT, check=True, capture_output=True, timeout=TIMEOUT_S)
    command = Command([sys.executable, "-m", "jaxreplay.cli", "eval", str(DEMO), *TINY, "task.eval_size=4096",
                       "run.progress_bar=true", "--checkpoint", str(run), "--k", "64", "--out", str(out)])
    command.wait_for_stderr("eval:")  # the progress bar: sampling has begun
    command.proc.send_signal(signal.SIGINT)
    status, _, stderr = command.finish()
    assert status == 130, stderr[-2000:]
    assert last_line(stderr.replace("\r", "\n")).startswith(f"{SIGINT_LINE} during the evaluation: nothing written")
    assert "Traceback" not in stderr
    assert not out.exists()
