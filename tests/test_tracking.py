"""W&B tracking (the `wandb` section) and `jaxreplay config --flat`.

The real `wandb` package writes offline runs (WANDB_MODE=offline); the tests read its run files
(RUN_DIR/wandb/offline-run-*/run-ID.wandb: W&B's record log of `wandb.proto` Records) back."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gcs_emulator import bucket, gcs_emulator  # noqa: F401 - fixtures
from jaxreplay import storage
from jaxreplay.config import ConfigError, load_config
from jaxreplay.train.accounting import HISTOGRAMS
from jaxreplay.train.metrics import read_metrics
from jaxreplay.train import rundir
from jaxreplay.train.recorder import RunRecorder, resume_config
from test_crash import cli, logged_step, wait_for_step
from test_train import DEMO, ROOT

OFFLINE = ["wandb.mode=offline", "wandb.project=jaxreplay-tests"]
# The test extra installs wandb on the default tier (not on the Reverb lane: pyproject.toml).
needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="needs wandb (the tracking extra)")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def next_second() -> None:
    """W&B names an offline run's folder by its start time, to the second, and its id: a resumed
    invocation started within the same second as the one before would write into that folder."""
    time.sleep(1.001 - time.time() % 1)


def wandb_records(path: Path):
    """The Records of one .wandb file: a 7-byte header, then 32 KiB blocks of chunks (checksum,
    length, type: FULL 1, FIRST 2, MIDDLE 3, LAST 4), as W&B's datastore writes them."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B", path
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending, pos = pending + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def offline_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run file under `run_dir`, the first started first: its run id, history rows (by key,
    decoded), config keys and last summary values."""
    runs = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        run = {"id": None, "start": None, "history": [], "config": set(), "summary": {}}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["start"] = record.run.run_id, record.run.start_time.ToNanoseconds()
                run["config"] |= {item.key for item in record.run.config.update}
            elif kind == "config":
                run["config"] |= {item.key for item in record.config.update}
            elif kind == "history":
                run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.history.item})
            elif kind == "summary":
                run["summary"].update({item.key: json.loads(item.value_json) for item in record.summary.update
                                       if item.key})
        runs.append(run)
    return sorted(runs, key=lambda run: run["start"])  # folder names tell time to the second only


@needs_wandb
def test_the_recorder_logs_scalars_histograms_config_and_summary_to_one_w_and_b_run_across_a_resume(tmp_path):
    config = load_config(DEMO, OFFLINE)
    counts = [0, 3, 1] + [0] * (len(HISTOGRAMS["replay/times_sampled_hist"]) - 3)
    with RunRecorder.open(tmp_path, config, None, log=lambda _: None) as recorder:
        for step in range(4):
            recorder.write(step, {"train/loss": 1.0 / (step + 1), "replay/times_sampled_hist": counts})
    run_id = json.loads((tmp_path / "wandb.json").read_text())["id"]
    next_second()
    # Resumed from the checkpoint at step 1: steps 2 and 3 are recorded again, and only once.
    with RunRecorder.open(tmp_path, config, 1, log=lambda _: None) as recorder:
        for step in (1, 2, 3, 4):  # step 1 is the checkpoint's: already logged
            recorder.write(step, {"train/loss": 10.0 + step})
        recorder.summary({"steps": 4, "eval/accuracy_end": 0.5})
    assert json.loads((tmp_path / "wandb.json").read_text())["id"] == run_id

    first, resumed = offline_runs(tmp_path)
    assert first["id"] == resumed["id"] == run_id
    assert [row["_step"] for row in first["history"]] == [0, 1, 2, 3]
    assert [row["_step"] for row in resumed["history"]] == [2, 3, 4]
    assert [row["train/loss"] for row in resumed["history"]] == [12.0, 13.0, 14.0]
    histogram = first["history"][0]
    assert histogram["replay/times_sampled_hist/_type"] == "histogram"
    assert sum(histogram["replay/times_sampled_hist/values"]) == 4
    assert {"train", "replay", "model", "wandb"} <= first["config"]
    assert resumed["summary"]["eval/accuracy_end"] == 0.5
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]


@needs_wandb
def test_a_bucket_run_dir_keeps_the_w_and_b_id_and_offline_files_in_the_bucket(bucket, tmp_path):
    config = load_config(DEMO, OFFLINE)
    for resume, steps in ((None, range(2)), (1, range(2, 4))):  # the second invocation: a fresh local mirror
        with rundir.claim(bucket, lease_s=5) as run_dir:
            with RunRecorder.open(run_dir, config, resume, log=lambda _: None) as recorder:
                for step in steps:
                    recorder.write(step, {"train/loss": float(step)})
        next_second()
    storage.download(storage.join(bucket, "wandb"), tmp_path / "copy" / "wandb")
    first, resumed = offline_runs(tmp_path / "copy")
    assert first["id"] == resumed["id"] == json.loads(storage.read_text(storage.join(bucket, "wandb.json")))["id"]
    assert [row["_step"] for row in first["history"] + resumed["history"]] == [0, 1, 2, 3]


@needs_wandb
def test_a_fresh_start_in_a_run_dir_without_a_checkpoint_begins_a_new_w_and_b_run(tmp_path):
    config = load_config(DEMO, OFFLINE)
    for _ in range(2):
        RunRecorder.open(tmp_path, config, None, log=lambda _: None).close()
    first, second = offline_runs(tmp_path)
    assert first["id"] != second["id"] == json.loads((tmp_path / "wandb.json").read_text())["id"]


@needs_wandb
def test_a_resume_may_turn_tracking_on_or_rename_it_but_not_move_it_to_another_project(tmp_path):
    RunRecorder.open(tmp_path, load_config(DEMO), None, log=lambda _: None).close()
    said = []
    resume_config(tmp_path, load_config(DEMO, ["wandb.mode=offline", "wandb.name=later"]), said.append)
    assert said == [f"resume with changed settings, recorded in {tmp_path / 'config.yaml'}: "
                    "wandb.mode: 'disabled' -> 'offline'; wandb.name: None -> 'later'"]
    with pytest.raises(ConfigError, match="^wandb.project: 'jaxreplay' -> 'elsewhere'; these change the run"):
        resume_config(tmp_path, load_config(DEMO, ["wandb.project=elsewhere"]), said.append)


def test_wandb_is_not_imported_when_disabled(tmp_path):
    code = ("import sys; from jaxreplay.config import load_config; from jaxreplay.train.recorder import RunRecorder; "
            f"RunRecorder.open({str(tmp_path)!r}, load_config(), None).close(); print('wandb' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr[-2000:]
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "wandb.json").exists()


@pytest.mark.parametrize("override, message", [
    ("wandb.mode=cloud", "wandb.mode: 'cloud' is not one of disabled, offline, online"),
    ("wandb.project=a/b", "wandb.project: 'a/b' is not a W&B project name"),
    ("wandb.entity=''", "wandb.entity: '' is not a W&B entity name"),
])
def test_bad_wandb_settings_are_refused_naming_the_key(override, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(")):
        load_config(DEMO, [override])


def test_config_flat_prints_dotted_lines_that_read_back_as_overrides_to_the_same_config():
    args = [sys.executable, "-m", "jaxreplay.cli", "config", str(DEMO), "task.operations=[+, '-']",
            "wandb.name='my run: 1'", "--flat"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "train.steps: 300" in lines and "wandb.mode: disabled" in lines and "model.hf_path: null" in lines
    overrides = [line.replace(": ", "=", 1) for line in lines]
    assert load_config(None, overrides) == load_config(DEMO, ["task.operations=[+, '-']", "wandb.name='my run: 1'"])


@pytest.mark.slow
@needs_wandb
def test_an_offline_demo_run_resumed_after_sigterm_is_one_w_and_b_run_with_each_step_once(tmp_path):
    run = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.Popen(cli(run, *OFFLINE, "checkpoint.every=1000"), cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, run, 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 143, stderr[-2000:]
    step = logged_step(run)
    rerun = subprocess.run(cli(run, *OFFLINE, "checkpoint.every=1000", f"train.steps={step + 2}"), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"resumed from step {step}" in rerun.stdout

    runs = offline_runs(run)
    assert len(runs) == 2 and {r["id"] for r in runs} == {json.loads((run / "wandb.json").read_text())["id"]}
    steps = [row["_step"] for r in runs for row in r["history"]]
    assert sorted(steps) == sorted(set(steps)) == [r["step"] for r in read_metrics(run)]
    assert steps[-1] == step + 2
    rows = {row["_step"]: row for r in runs for row in r["history"]}
    for record in read_metrics(run):  # the same scalars and histograms as metrics.jsonl (and TensorBoard)
        for key, value in record.items():
            if key in HISTOGRAMS and value and sum(value):
                assert rows[record["step"]][f"{key}/_type"] == "histogram"
            elif key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                assert rows[record["step"]][key] == pytest.approx(value), key
    assert runs[-1]["summary"]["steps"] == step + 2
