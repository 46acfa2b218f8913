"""Run dirs and inputs in a bucket, on a real GCS server (gcs_emulator.py): the storage layer's
promises, the run dir's lease, and training runs killed and resumed from the bucket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from gcs_emulator import bucket, gcs_emulator  # noqa: F401 - fixtures
from jaxreplay import storage
from jaxreplay.config import ConfigError, load_config
from jaxreplay.train import rundir
from test_train import DEMO, ROOT, TINY


def test_files_round_trip_through_a_bucket(bucket, tmp_path):
    storage.write_text(storage.join(bucket, "a", "b.txt"), "hello")
    assert storage.read_text(storage.join(bucket, "a", "b.txt")) == "hello"
    assert storage.exists(storage.join(bucket, "a")) and storage.isdir(storage.join(bucket, "a"))
    assert storage.listdir(bucket) == ["a"] and storage.listdir(storage.join(bucket, "a")) == ["b.txt"]
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(bucket, "missing"))
    storage.rmtree(storage.join(bucket, "a"))
    assert storage.listdir(bucket) == [] and not storage.exists(storage.join(bucket, "a", "b.txt"))


@pytest.mark.parametrize("data", [b"ab\r", b"ab\n", b"ab\r\n", b"\r\nab", b"\r", bytes(range(256)) + b"\r"],
                         ids=["ends CR", "ends LF", "ends CRLF", "starts CRLF", "only CR", "every byte, then CR"])
def test_bytes_round_trip_exactly_whatever_their_last_byte(bucket, tmp_path, data):
    """Checkpoint files are arbitrary bytes: an OCDBT manifest ending in CR once came back a byte short."""
    storage.write_bytes(storage.join(bucket, "written"), data)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "uploaded").write_bytes(data)
    storage.upload(tmp_path / "dir", storage.join(bucket, "dir"))
    assert storage.read_bytes(storage.join(bucket, "written")) == data
    assert (storage.staged(storage.join(bucket, "dir")) / "uploaded").read_bytes() == data


def test_a_directory_is_uploaded_with_its_marker_last_and_staged_afresh_when_it_changes(bucket, tmp_path):
    local = tmp_path / "ckpt"
    (local / "sub").mkdir(parents=True)
    for name in ("DONE", "a.npz", "sub/b.json"):
        (local / name).write_text(name)
    storage.upload(local, storage.join(bucket, "ckpt"), last=["DONE"])
    staged = storage.staged(storage.join(bucket, "ckpt"))
    assert sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file()) == \
        ["DONE", "a.npz", "sub/b.json"]
    assert storage.staged(storage.join(bucket, "ckpt")) == staged  # unchanged: the same copy
    storage.write_text(storage.join(bucket, "ckpt", "a.npz"), "new")
    again = storage.staged(storage.join(bucket, "ckpt"))
    assert again != staged and (again / "a.npz").read_text() == "new"


def test_local_writes_are_whole_or_absent(tmp_path):
    path = tmp_path / "f.json"
    storage.write_text(path, "one")
    storage.write_text(path, "two")
    assert path.read_text() == "two" and sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


@pytest.mark.parametrize("key,value,why", [
    ("run.dir", "s3://b/run", "only local paths and gs:// URLs are supported"),
    ("run.dir", "gs://", "does not name a bucket"),
    ("task.path", "https://example.com/{split}.jsonl", "only local paths and gs:// URLs are supported"),
])
def test_unsupported_urls_are_config_errors_naming_the_key(key, value, why):
    with pytest.raises(ConfigError, match=f"^{key}: .*{why}"):
        load_config(DEMO, [f"{key}={value}"], local=False)


def test_an_hf_model_and_its_tokenizer_load_from_a_bucket_as_from_a_disk(bucket, tmp_path):
    import jax
    import numpy as np

    from jaxreplay.models.hf import load_hf_model, read_model_config
    from jaxreplay.models.tokenizer import load_tokenizer
    from tiny_hf import write_model

    local = write_model(tmp_path / "hf")
    url = storage.join(bucket, "models", "tiny")
    storage.upload(local, url)
    cfg = read_model_config(url)
    assert cfg == read_model_config(local).__class__(**{**vars(read_model_config(local)), "hf_path": url})
    _, _, params = load_hf_model(url)
    _, _, expected = load_hf_model(local)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)))
    assert load_tokenizer(url).encode("1+2=") == load_tokenizer(local).encode("1+2=")


def test_a_dataset_reads_from_a_bucket_as_from_a_disk(bucket, tmp_path):
    import json as json_module

    from jaxreplay.tasks.datasets import split_files

    for split in ("train", "test"):
        (tmp_path / "data" / split).parent.mkdir(exist_ok=True)
        (tmp_path / "data" / f"{split}.jsonl").write_text(
            "".join(json_module.dumps({"question": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(5)))
    storage.upload(tmp_path / "data", storage.join(bucket, "data"))
    for path in (storage.join(bucket, "data", "{split}.jsonl"), storage.join(bucket, "data")):
        files = split_files(path, "train")
        assert [f.read_text() for f in files] == [(tmp_path / "data" / "train.jsonl").read_text()]


HOLD = textwrap.dedent("""
    import sys, time
    from jaxreplay.train import rundir
    with rundir.claim(sys.argv[1], lease_s=float(sys.argv[2])):
        print("held", flush=True)
        time.sleep(600)
""")


def test_a_live_lease_refuses_a_second_run_and_a_killed_holders_lease_is_taken_once_expired(bucket):
    lease_s = 4.0
    holder = subprocess.Popen([sys.executable, "-c", HOLD, bucket, str(lease_s)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waited = []
        with pytest.raises(rundir.RunDirError, match=rf"in use by another run \(process {holder.pid} on .*renewed"):
            with rundir.claim(bucket, lease_s=lease_s, log=waited.append):
                pass
        assert waited and "waiting to see whether it is" in waited[0]
    finally:
        holder.kill()
        holder.wait()
    killed_at = time.monotonic()
    with rundir.claim(bucket, lease_s=lease_s, log=lambda _: None) as run_dir:  # waits for the dead holder's lease
        taken_after = time.monotonic() - killed_at
        held = json.loads(storage.read_text(storage.join(bucket, rundir.LOCK_FILE)))
        assert held["pid"] == os.getpid() and run_dir.remote
    assert taken_after <= lease_s + 2
    assert not storage.exists(storage.join(bucket, rundir.LOCK_FILE))  # released at the end of the claim


# -- training runs in a bucket ---------------------------------------------------------------------

STEPS, EVERY = 30, 10
RUN = [*TINY, f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep=2", "train.eval_every=1000",
       "run.progress_bar=false", "run.lease_s=8"]  # a short lease: the resume waits for the killed run's to expire


def train_cli(run_dir: str, *overrides: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxreplay.cli", "train", str(DEMO), *RUN, *overrides,
                             f"run.dir={run_dir}"], cwd=popen.pop("cwd"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def bucket_steps(url: str) -> list[int]:
    """Finished Orbax steps: on a bucket (no rename) Orbax marks a finished step with commit_success.txt."""
    root = storage.join(url, "checkpoints")
    return sorted(int(name) for name in storage.listdir(root)
                  if name.isdigit() and storage.exists(storage.join(root, name, "commit_success.txt")))


def metric_steps(url: str) -> list[int]:
    text = storage.read_text(storage.join(url, "metrics.jsonl"))
    return [json.loads(line)["step"] for line in text.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("placement", [
    [], ["mesh.actor_devices=1"],
    # Reverb through its sidecar (the default tier), its actor and learner threads each on a connection of their
    # own: Reverb writes its checkpoints locally, the storage layer uploads them
    pytest.param(["mesh.actor_devices=1", "replay.backend=reverb"], marks=pytest.mark.needs_sidecar)],
    ids=["colocated", "disaggregated", "disaggregated-reverb-sidecar"])
def test_a_bucket_run_killed_after_its_second_checkpoint_resumes_from_the_bucket(bucket, tmp_path, placement):
    from conftest import cpu_devices_env
    env = cpu_devices_env(2) if "mesh.actor_devices=1" in placement else dict(os.environ)
    run_url = storage.join(bucket, "run")
    # Trained far past STEPS, so that it cannot finish before it is killed, however fast the machine.
    first = train_cli(run_url, *placement, f"train.steps={100 * STEPS}", cwd=tmp_path, env=env)
    deadline = time.monotonic() + 600
    while len(bucket_steps(run_url)) < 2 or bucket_steps(run_url)[-1] < 2 * EVERY:
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "no second checkpoint in the bucket"
        time.sleep(0.5)
    first.send_signal(signal.SIGKILL)
    first.wait()
    steps = bucket_steps(run_url)[-1] + EVERY  # where the resumed run stops: past its latest complete step

    second = train_cli(run_url, *placement, f"train.steps={steps}", cwd=tmp_path, env=env)
    out = second.communicate(timeout=600)[0]
    assert second.returncode == 0, out
    resumed = int(out.split("resumed from step ")[1].split()[0])
    assert resumed >= 2 * EVERY, out
    assert metric_steps(run_url) == list(range(0, steps + 1))  # each step once (0: the start-up evaluation)
    assert json.loads(storage.read_text(storage.join(run_url, "summary.json")))["steps"] == steps
    stored = yaml.safe_load(storage.read_text(storage.join(run_url, "config.yaml")))
    assert stored["run"]["dir"] == run_url and stored["train"]["steps"] == steps
    assert not (tmp_path / "gs:").exists() and not any(p.name.startswith("gs:") for p in tmp_path.rglob("*"))
    kept = storage.listdir(storage.join(run_url, "replay"))
    assert 1 <= len(kept) <= 2, kept  # the kept steps' replay checkpoints, no more
    assert storage.listdir(storage.join(run_url, "tensorboard"))  # TensorBoard's event files, uploaded
    if placement:
        return
    # A copied run resumes: bucket -> disk, then disk -> another bucket prefix.
    on_disk = tmp_path / "copied"
    storage.download(run_url, on_disk)
    out = train_cli(str(on_disk), f"train.steps={steps + 2}", cwd=tmp_path).communicate(timeout=600)[0]
    assert f"resumed from step {steps}" in out and f"done: {steps + 2} steps" in out, out
    back = storage.join(bucket, "copied-back")
    storage.upload(on_disk, back)
    out = train_cli(back, f"train.steps={steps + 4}", cwd=tmp_path).communicate(timeout=600)[0]
    assert f"resumed from step {steps + 2}" in out and f"done: {steps + 4} steps" in out, out
    assert metric_steps(back) == list(range(0, steps + 5))


@pytest.mark.slow
@pytest.mark.parametrize("sig,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signalled_bucket_run_saves_to_the_bucket_and_resumes(bucket, tmp_path, sig, status):
    run_url = storage.join(bucket, "run")
    first = train_cli(run_url, "checkpoint.every=5", cwd=tmp_path)
    deadline = time.monotonic() + 600
    while not bucket_steps(run_url):  # a first checkpoint: the run is training
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline, "no checkpoint in the bucket"
        time.sleep(0.2)
    first.send_signal(sig)
    out = first.communicate(timeout=120)[0]
    assert first.returncode == status, out
    saved = bucket_steps(run_url)[-1]  # the final checkpoint, at the step the signal stopped
    assert f"checkpoint at step {saved}" in out, out
    second = train_cli(run_url, "checkpoint.every=5", cwd=tmp_path)
    out = second.communicate(timeout=600)[0]
    assert second.returncode == 0 and f"resumed from step {saved}" in out, out
    assert metric_steps(run_url) == list(range(0, STEPS + 1))
