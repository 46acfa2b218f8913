"""Every placement resumes: killed at random moments, moved to another directory, or
restarted with a changed config, a run continues from its last checkpoint with true records.

Real `jaxreplay train` processes of the tiny model: disaggregated on 4 host devices,
multi-host as 2 processes of one JAX job (the colocated kill test is test_crash.py's).
Kill moments come from seeded generators, so a failure reproduces.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxreplay.compat import multiprocess_checkpoint_gap
from test_train import DEMO, ROOT, TINY
from conftest import cpu_devices_env

pytestmark = pytest.mark.slow

FOUR_DEVICES, TWO_DEVICES = cpu_devices_env(4), cpu_devices_env(2)
SMALL = [*TINY, "warmstart.steps=0", "train.eval_every=1000", "run.progress_bar=false"]
DISAGGREGATED = [*SMALL, "mesh.actor_devices=2", "mesh.data=-1", "train.batch_size=16", "train.prompts_per_step=2",
                 "replay.max_size=128", "replay.min_size_to_sample=16", "replay.samples_per_insert=2",
                 "train.weight_sync_every=2", "replay.backend=inprocess"]
MULTIHOST = [*SMALL, "mesh.data=-1", "train.batch_size=16", "train.prompts_per_step=4", "train.group_size=8",
             "replay.max_size=64", "replay.min_size_to_sample=8", "replay.samples_per_insert=2",
             "replay.backend=inprocess", "distributed.enabled=true", "distributed.num_processes=2"]


def cli(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "jaxreplay.cli", "train", str(DEMO), *overrides, f"run.dir={run_dir}"]


def metric_steps(run_dir: Path) -> list[int]:
    """Learner steps in metrics.jsonl, in file order (step 0 is the evaluation at the start)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.endswith("}") and json.loads(line)["step"] > 0]


def checkpoint_steps(run_dir: Path) -> list[int]:
    directory = run_dir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def logged_step(run_dir: Path) -> int:
    return max(metric_steps(run_dir), default=0) if (run_dir / "metrics.jsonl").exists() else 0


def kill_moment(procs: list[subprocess.Popen], run_dir: Path, rng: np.random.Generator, every: int,
                timeout_s: float = 300) -> None:
    """Returns at a moment drawn from `rng` after the run's next checkpoint: once it logged a
    step 1 to 2 checkpoint intervals past where it started, and then 0 to 50 ms later."""
    start = max(checkpoint_steps(run_dir), default=0)
    target = start + every + int(rng.integers(0, every + 1))
    deadline = time.monotonic() + timeout_s
    while logged_step(run_dir) < target or max(checkpoint_steps(run_dir), default=0) <= start:
        for p in procs:
            assert p.poll() is None, f"the run ended (rc {p.returncode}) before step {target}"
        assert time.monotonic() < deadline, f"no step {target} within {timeout_s}s"
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.05))


def assert_records_true(run_dir: Path, steps: int, target_ratio: float) -> dict:
    """Every step recorded once, in order; the run ended at its target ratio."""
    assert metric_steps(run_dir) == list(range(1, steps + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == steps
    assert abs(summary["replay/ratio"] / target_ratio - 1) <= 0.10, summary["replay/ratio"]
    return summary


def resumed_from(log: str) -> int:
    line = next(line for line in log.splitlines() if line.startswith("resumed from step "))
    return int(line.split()[3])


def test_a_disaggregated_run_killed_three_times_resumes_each_time_and_records_each_step_once(tmp_path):
    run, steps = tmp_path / "run", 48  # long enough for the ratio to settle within 10% of its target
    args = cli(run, *DISAGGREGATED, f"train.steps={steps}", "checkpoint.every=4")
    rng = np.random.default_rng(14)
    for _ in range(3):
        proc = subprocess.Popen(args, cwd=ROOT, env=FOUR_DEVICES, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            kill_moment([proc], run, rng, every=4)
        finally:
            proc.kill()
            proc.wait(timeout=60)
        assert max(checkpoint_steps(run)) < steps, "the run finished before it was killed"
    last = max(checkpoint_steps(run))
    result = subprocess.run(args, cwd=ROOT, env=FOUR_DEVICES, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert resumed_from(result.stdout) == last
    assert "table restored as checkpointed" in result.stdout
    assert_records_true(run, steps, target_ratio=2.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job(run_dir: Path, *overrides: str, only_process_0: tuple[str, ...] = ()) -> list[subprocess.Popen]:
    address = f"distributed.coordinator_address=127.0.0.1:{_free_port()}"
    return [subprocess.Popen(cli(run_dir, *MULTIHOST, address, f"distributed.process_id={i}", *overrides,
                                 *(only_process_0 if i == 0 else ())), cwd=ROOT,
                             env=TWO_DEVICES, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for i in range(2)]


def _finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str]]:
    deadline, results = time.monotonic() + timeout_s, []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


needs_multiprocess_checkpoints = pytest.mark.skipif(
    multiprocess_checkpoint_gap() is not None, reason=f"this tier: {multiprocess_checkpoint_gap()}")


@needs_multiprocess_checkpoints
def test_a_multihost_job_with_a_process_killed_three_times_stops_in_seconds_and_resumes(tmp_path):
    """SIGKILL one process of two after a checkpoint: the other stops within seconds (not at
    the 600 s coordination timeout); the relaunched job resumes from the last checkpoint."""
    run, steps = tmp_path / "run", 16
    overrides = [f"train.steps={steps}", "checkpoint.every=2", "distributed.timeout_s=600"]
    rng = np.random.default_rng(15)
    for victim in (1, 0, 1):
        procs = _job(run, *overrides)
        try:
            kill_moment(procs, run, rng, every=2)
            procs[victim].kill()
            killed_at = time.monotonic()
            survivor = procs[1 - victim]
            survivor.communicate(timeout=120)
            assert time.monotonic() - killed_at < 60, "the surviving process waited for its timeout"
            assert survivor.returncode != 0
        finally:
            _finish(procs, 1)
        assert max(checkpoint_steps(run)) < steps, "the run finished before it was killed"
    last = max(checkpoint_steps(run))
    results = _finish(_job(run, *overrides), 600)
    for rc, out in results:
        assert rc == 0, out[-3000:]
    assert resumed_from(results[0][1]) == last
    assert_records_true(run, steps, target_ratio=2.0)
    digests = [json.loads((run / f"process-{i}.json").read_text())["params_sha256"] for i in range(2)]
    assert digests[0] == digests[1]


@pytest.mark.parametrize("placement, env, overrides", [
    ("disaggregated", FOUR_DEVICES, DISAGGREGATED),
    pytest.param("multihost", TWO_DEVICES, MULTIHOST, marks=needs_multiprocess_checkpoints),
])
def test_sigterm_saves_a_final_checkpoint_in_every_placement(tmp_path, placement, env, overrides):
    run = tmp_path / "run"
    extra = ["train.steps=400", "checkpoint.every=1000"]
    procs = (_job(run, *extra) if placement == "multihost" else
             [subprocess.Popen(cli(run, *overrides, *extra), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)])
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() or len(metric_steps(run)) < 3:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.1)
    procs[-1].send_signal(signal.SIGTERM)
    results = _finish(procs, 180)
    assert [rc for rc, _ in results] == [128 + signal.SIGTERM] * len(procs), [out[-2000:] for _, out in results]
    saved = checkpoint_steps(run)
    assert saved and saved[-1] >= 3 and saved[-1] == metric_steps(run)[-1]


def test_a_copied_run_dir_resumes_from_its_own_buffer_with_the_original_deleted(tmp_path):
    original, copy = tmp_path / "original", tmp_path / "copy"
    common = [*SMALL, "replay.backend=inprocess", "checkpoint.every=3"]
    subprocess.run(cli(original, *common, "train.steps=6"), cwd=ROOT, check=True, capture_output=True, timeout=600)
    shutil.copytree(original, copy)
    shutil.rmtree(original)
    result = subprocess.run(cli(copy, *common, "train.steps=9"), cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert resumed_from(result.stdout) == 6
    assert "table restored as checkpointed" in result.stdout
    assert not original.exists()
    assert metric_steps(copy) == list(range(1, 10))
    meta = json.loads(next((copy / "checkpoints" / "9").rglob("meta/metadata")).read_text())
    assert not os.path.isabs(meta["replay_checkpoint"])


def test_a_resume_with_a_changed_seed_is_refused_and_leaves_the_records_untouched(tmp_path):
    run = tmp_path / "run"
    common = [*SMALL, "replay.backend=inprocess", "checkpoint.every=2", "train.steps=2"]
    subprocess.run(cli(run, *common), cwd=ROOT, check=True, capture_output=True, timeout=600)
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "summary.json")}
    result = subprocess.run(cli(run, *common, "train.steps=4", "run.seed=1"), cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 2
    assert "run.seed: 0 -> 1" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert {name: (run / name).read_bytes() for name in before} == before
    assert checkpoint_steps(run) == [2]


def test_a_hand_edit_of_config_yaml_that_the_checkpoint_overrules_is_said_and_written_back(tmp_path):
    run = tmp_path / "run"
    common = [*SMALL, "replay.backend=inprocess", "checkpoint.every=2"]
    subprocess.run(cli(run, *common, "train.steps=2"), cwd=ROOT, check=True, capture_output=True, timeout=600)
    edited = (run / "config.yaml").read_text().replace("samples_per_insert: 2.0", "samples_per_insert: 4.0")
    (run / "config.yaml").write_text(edited)
    result = subprocess.run(cli(run, *common, "train.steps=4"), cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "was edited" in line]  # a warning: stderr, as errors
    assert len(said) == 1 and "it says replay.samples_per_insert: 4.0" in said[0], result.stderr[-3000:]
    assert said[0].startswith("warning: ") and "was edited" not in result.stdout
    assert "goes on with replay.samples_per_insert: 2.0" in said[0]
    assert "samples_per_insert: 2.0" in (run / "config.yaml").read_text() and checkpoint_steps(run) == [2, 4]
    # The same edit with the same value on the command line: a change of the run, refused in one line
    (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("samples_per_insert: 2.0",
                                                                              "samples_per_insert: 4.0"))
    before = {name: (run / name).read_bytes() for name in ("config.yaml", "metrics.jsonl", "summary.json")}
    result = subprocess.run(cli(run, *common, "train.steps=6", "replay.samples_per_insert=4"), cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 2
    assert "replay.samples_per_insert: 2.0 -> 4.0" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert {name: (run / name).read_bytes() for name in before} == before and checkpoint_steps(run) == [2, 4]


def test_checkpoints_follow_the_clock_as_well_as_the_step_count(tmp_path):
    run = tmp_path / "run"
    subprocess.run(cli(run, *SMALL, "replay.backend=inprocess", "train.steps=4", "checkpoint.every=1000",
                       "checkpoint.every_seconds=0.000001", "checkpoint.keep=10"),
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    assert checkpoint_steps(run) == [1, 2, 3, 4]


@needs_multiprocess_checkpoints
def test_a_multihost_job_checkpoints_when_any_process_clock_says_so(tmp_path):
    """Only process 0's clock makes saves due (as when process 1's runs behind): both save."""
    run = tmp_path / "run"
    results = _finish(_job(run, "train.steps=4", "checkpoint.every=1000", "checkpoint.keep=10",
                           "checkpoint.every_seconds=3600", only_process_0=("checkpoint.every_seconds=0.000001",)), 400)
    assert [rc for rc, _ in results] == [0, 0], [out[-2000:] for _, out in results]
    assert checkpoint_steps(run) == [1, 2, 3, 4]


def test_a_restart_with_nothing_to_resume_says_so(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run:\n  seed: 0\n")  # an attempt killed before its first checkpoint
    result = subprocess.run(cli(run, *SMALL, "replay.backend=inprocess", "train.steps=1"), cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"no checkpoint to resume in {run}" in result.stdout


@pytest.mark.tier
def test_a_resume_on_another_mesh_reshards_the_checkpoint(tmp_path):
    """Moving to another slice size is routine: a run saved on a 4-way data-parallel mesh resumes
    on a 2x2 data x fsdp mesh, its params and optimizer state resharded by the restore."""
    run = tmp_path / "run"
    common = [*SMALL, "replay.backend=inprocess", "checkpoint.every=2"]
    subprocess.run(cli(run, *common, "train.steps=2", "mesh.data=4"), cwd=ROOT, env=FOUR_DEVICES, check=True,
                   capture_output=True, timeout=600)
    result = subprocess.run(cli(run, *common, "train.steps=4", "mesh.data=2", "mesh.fsdp=2"), cwd=ROOT,
                            env=FOUR_DEVICES, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert resumed_from(result.stdout) == 2
    assert "mesh data=2 fsdp=2 tensor=1" in result.stdout
    assert "mesh.fsdp: 1 -> 2" in result.stdout  # an allowed change, said and recorded
    assert metric_steps(run) == [1, 2, 3, 4]
