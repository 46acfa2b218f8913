"""Multi-host runs where pods keep them: a run dir in a bucket, killed and resumed, and a pod whose
workers each have their own disk, which must end at start-up instead of hanging in its first save.

Two `jaxreplay train` processes on localhost (2 CPU devices each, gloo) stand in for a pod's
workers, as in test_multihost.py; the bucket is a real GCS server (gcs_emulator.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cpu_devices_env
from gcs_emulator import bucket, gcs_emulator  # noqa: F401 - fixtures
from jaxreplay import storage
from test_multihost import ROOT, TINY, _free_port

STEPS, EVERY = 8, 2
RUN = [*TINY, f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep=3", "run.lease_s=8",
       "replay.backend=inprocess"]


def start(run_dir: str, *overrides: str, timeout_s: float = 60, wrap=lambda i, argv: argv) -> list[subprocess.Popen]:
    """One `jaxreplay train` per process; `wrap(i, argv)` may run process i inside another command."""
    address = f"127.0.0.1:{_free_port()}"
    common = [*RUN, *overrides, f"run.dir={run_dir}", "distributed.enabled=true", "distributed.num_processes=2",
              f"distributed.coordinator_address={address}", f"distributed.timeout_s={timeout_s}"]
    return [subprocess.Popen(wrap(i, [sys.executable, "-m", "jaxreplay.cli", "train", "configs/demo.yaml", *common,
                                      f"distributed.process_id={i}"]),
                             cwd=ROOT, env=cpu_devices_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True) for i in range(2)]


def finish(procs: list[subprocess.Popen], timeout_s: float) -> list[tuple[int, str]]:
    deadline = time.monotonic() + timeout_s
    try:
        outputs = [p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def succeeded(results: list[tuple[int, str]]) -> None:
    assert all(rc == 0 for rc, _ in results), "\n".join(f"--- process {i} (exit {rc}):\n{out[-3000:]}"
                                                        for i, (rc, out) in enumerate(results))


def step_dirs(url: str) -> dict[int, bool]:
    """Orbax's step directories in the bucket: step -> finished (commit_success.txt written)."""
    root = storage.join(url, "checkpoints")
    return {int(n): storage.exists(storage.join(root, n, "commit_success.txt"))
            for n in storage.listdir(root) if n.isdigit()}


def digests(url: str) -> list[str]:
    return [json.loads(storage.read_text(storage.join(url, f"process-{i}.json")))["params_sha256"] for i in range(2)]


@pytest.mark.slow
def test_two_processes_killed_during_a_save_resume_from_the_bucket_and_match_an_uninterrupted_run(bucket):
    straight = storage.join(bucket, "straight")
    succeeded(finish(start(straight), timeout_s=400))
    expected = digests(straight)
    assert expected[0] == expected[1]

    run = storage.join(bucket, "killed")
    procs = start(run)
    deadline = time.monotonic() + 400
    while True:  # both killed while a step after the first finished one is being written
        steps = step_dirs(run)
        done = [s for s, finished in steps.items() if finished]
        if done and any(not finished and s > min(done) for s, finished in steps.items()):
            break
        assert all(p.poll() is None for p in procs), finish(procs, 10)
        assert time.monotonic() < deadline, f"no save caught in progress: {steps}"
        time.sleep(0.02)
    for p in procs:
        p.kill()
    finish(procs, 10)
    complete = max(s for s, finished in step_dirs(run).items() if finished)

    results = finish(start(run), timeout_s=400)
    succeeded(results)
    assert f"resumed from step {complete}" in results[0][1], results[0][1]
    assert digests(run) == expected  # bit-identical to the run never interrupted
    metrics = [json.loads(line)["step"] for line in storage.read_text(storage.join(run, "metrics.jsonl")).splitlines()]
    assert metrics == sorted(set(metrics)) and metrics[-1] == STEPS  # each step once


@pytest.mark.slow
@pytest.mark.reverb
def test_two_processes_on_one_reverb_table_in_a_bucket_resume_from_its_checkpoint_there(bucket):
    """Process 0's Reverb table is uploaded with each step (before: each process pushed a shard's
    path, where Reverb's one table has none, so no replay checkpoint reached the bucket)."""
    run = storage.join(bucket, "reverb")
    succeeded(finish(start(run, "train.steps=4", "replay.backend=reverb"), timeout_s=400))
    meta = json.loads(storage.read_text(storage.join(run, "checkpoints", "4", "meta", "metadata")))
    names = json.loads(meta["replay_checkpoint"])
    assert names[1] == "" and storage.exists(storage.join(run, "replay", names[0], "DONE"))

    # fresh mirrors: the table comes from the bucket
    results = finish(start(run, "train.steps=6", "replay.backend=reverb"), timeout_s=400)
    succeeded(results)
    assert "resumed from step 4 " in results[0][1], results[0][1][-3000:]
    assert json.loads(storage.read_text(storage.join(run, "summary.json")))["steps"] == 6


def test_a_pod_whose_workers_have_private_disks_ends_at_start_up_naming_run_dir(tmp_path):
    """Each process sees its own directory at the same run.dir path (a private mount namespace
    with a bind mount, as each TPU VM has its own disk). With distributed.timeout_s at 600 s, both
    end in seconds with one line, instead of Orbax's 10-minute wait at the first save."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("private mount namespaces need unshare -m (root, or user namespaces)")
    shared = tmp_path / "run"
    shared.mkdir()
    for i in range(2):
        (tmp_path / f"disk-{i}").mkdir()

    def private_disk(i: int, argv: list[str]) -> list[str]:
        quoted = " ".join(f"'{a}'" for a in argv)
        return ["unshare", "-m", "sh", "-c", f"mount --bind '{tmp_path / f'disk-{i}'}' '{shared}' && exec {quoted}"]

    began = time.monotonic()
    results = finish(start(str(shared), timeout_s=600, wrap=private_disk), timeout_s=180)
    took = time.monotonic() - began
    for rc, out in results:
        assert rc == 2, out
        assert "is not one directory shared by the job's processes" in out and f"run.dir: '{shared}'" in out, out
    assert took < 120, took  # far below distributed.timeout_s (600 s) and Orbax's wait (600 s)
    assert not any((tmp_path / "disk-0").glob("checkpoints/*"))
