"""The run recorder: config.yaml says what the run used, and a resumed run's records hold each step once."""

import json
import re
import struct

import pytest
import yaml

from jaxreplay.config import ConfigError, load_config
from jaxreplay.train.metrics import read_metrics
from jaxreplay.train.recorder import MAY_CHANGE_ON_RESUME, RunRecorder, last_summary, may_change, run_settings


def config(run_dir, *overrides):
    """Checked as for another machine (local=False): replay.backend=reverb must load without Reverb."""
    return load_config(None, [f"run.dir={run_dir}", "replay.backend=inprocess", "train.steps=40", *overrides],
                       local=False)


def run(run_dir, cfg, resume_step, steps, value=1.0, log=None):
    """One invocation: opens the recorder and writes `steps`, as a driver would."""
    lines = []
    recorder = RunRecorder.open(run_dir, cfg, resume_step, log=log or lines.append)
    with recorder:
        for step in steps:
            recorder.write(step, {"loss": value + step})
    return recorder, lines


def steps_in(run_dir):
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def files(run_dir):
    return {p.relative_to(run_dir): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_resume_that_changes_the_run_is_refused_and_writes_nothing(tmp_path):
    run(tmp_path, config(tmp_path), None, range(8))
    before = files(tmp_path)
    changed = config(tmp_path, "run.seed=1", "replay.selector=fifo", "train.steps=80")
    with pytest.raises(ConfigError) as refused:
        RunRecorder.open(tmp_path, changed, resume_step=4, log=print)
    message = str(refused.value)
    assert "\n" not in message
    assert "run.seed: 0 -> 1" in message and "replay.selector: 'uniform' -> 'fifo'" in message
    assert "train.steps" not in message  # allowed; only what changes the run is named
    assert "use a new run.dir, or restore the old values" in message
    assert files(tmp_path) == before  # config.yaml byte-identical, metrics and TensorBoard untouched


def test_a_resume_that_adds_changes_or_drops_a_generator_setting_is_refused(tmp_path):
    """task.dataset_config is one mapping: each of its entries is a setting of the run."""
    gym = ["task.name=reasoning_gym", "task.dataset=products", "warmstart.steps=0", "model.vocab_size=259",
           "model.max_seq_len=300", "task.dataset_config.max_digits=3", "task.dataset_config.min_digits=2"]
    run(tmp_path, config(tmp_path, *gym), None, range(3))
    for change, said in [(["task.dataset_config.max_digits=4"], "task.dataset_config.max_digits: 3 -> 4"),
                         (["task.dataset_config.max_terms=3"], "task.dataset_config.max_terms: None -> 3"),
                         (["task.dataset_config={max_digits: 3}"], "task.dataset_config.min_digits: 2 -> (unset)")]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            RunRecorder.open(tmp_path, config(tmp_path, *gym, *change), resume_step=2, log=print)
    run(tmp_path, config(tmp_path, *gym), 2, [3])  # the same settings resume


def test_an_allowed_change_is_accepted_logged_and_recorded(tmp_path):
    run(tmp_path, config(tmp_path), None, range(5))
    moved = config(tmp_path, "train.steps=80", "checkpoint.every=7", "replay.timeout_s=5", "mesh.fsdp=-1")
    recorder, lines = run(tmp_path, moved, 4, [5])
    stored = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert stored["train"]["steps"] == 80 and stored["checkpoint"]["every"] == 7 and stored["mesh"]["fsdp"] == -1
    assert recorder.config == moved
    assert any("train.steps: 40 -> 80" in line and "replay.timeout_s: 60.0 -> 5.0" in line for line in lines)


def test_allow_list_says_why_and_refuses_what_changes_the_run():
    assert all(why for why in MAY_CHANGE_ON_RESUME.values())
    for key in ["train.steps", "replay.timeout_s", "distributed.timeout_s", "replay.port", "mesh.tensor",
                "distributed.coordinator_address", "run.dir"]:
        assert may_change(key), key
    for key in ["run.seed", "model.d_model", "task.name", "warmstart.steps", "replay.selector",
                "replay.samples_per_insert", "train.loss", "train.kl_coef", "mesh.actor_devices"]:
        assert not may_change(key), key


def test_metrics_past_the_resume_step_are_dropped_so_each_step_appears_once(tmp_path):
    cfg = config(tmp_path)
    run(tmp_path, cfg, None, range(7), value=1.0)  # killed after step 6; the checkpoint is at 4
    _, lines = run(tmp_path, cfg, 4, range(5, 9), value=100.0)
    assert steps_in(tmp_path) == list(range(9))
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path)}
    assert losses[4] == 5.0 and losses[5] == 105.0  # the resumed run's rows, not the dead one's
    assert any("dropped 2 rows past the checkpoint at step 4" in line for line in lines)


def test_a_torn_last_line_is_dropped(tmp_path):
    cfg = config(tmp_path)
    run(tmp_path, cfg, None, range(4))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "lo')  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3]  # readable as it is
    run(tmp_path, cfg, 3, [4, 5])
    assert steps_in(tmp_path) == [0, 1, 2, 3, 4, 5]


def test_a_fresh_start_overwrites_what_an_attempt_without_a_checkpoint_left(tmp_path):
    run(tmp_path, config(tmp_path), None, range(3))
    recorder, _ = run(tmp_path, config(tmp_path, "run.seed=5"), None, [0])
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["run"]["seed"] == 5
    assert steps_in(tmp_path) == [0]


@pytest.mark.tier
def test_auto_backend_matches_the_stored_one_and_another_backend_is_refused(tmp_path):
    run(tmp_path, config(tmp_path), None, [0])
    recorder, _ = run(tmp_path, config(tmp_path, "replay.backend=auto"), 0, [])
    assert recorder.config.replay.backend == "inprocess"  # what the run has, recorded
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["replay"]["backend"] == "inprocess"
    with pytest.raises(ConfigError, match=r"replay.backend: 'inprocess' -> 'reverb'"):
        RunRecorder.open(tmp_path, config(tmp_path, "replay.backend=reverb"), 0, log=print)


def test_a_calibrated_ratio_is_kept_on_resume(tmp_path):
    cfg = config(tmp_path, "replay.calibrate_steps=2")
    recorder, _ = run(tmp_path, cfg, None, [])
    calibrated = config(tmp_path, "replay.calibrate_steps=2", "replay.samples_per_insert=3.25")
    recorder = RunRecorder.open(tmp_path, cfg, None, log=print)
    recorder.update_config(calibrated)
    recorder.close()
    resumed, _ = run(tmp_path, cfg, 0, [])  # the config as given, before calibration: 2.0
    assert resumed.config.replay.samples_per_insert == 3.25
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["replay"]["samples_per_insert"] == 3.25
    uncalibrated = config(tmp_path, "replay.samples_per_insert=3.0")
    with pytest.raises(ConfigError, match="replay.calibrate_steps: 2 -> 0"):
        RunRecorder.open(tmp_path, uncalibrated, 0, log=print)


def test_a_key_missing_from_an_older_config_compares_with_its_default(tmp_path):
    run(tmp_path, config(tmp_path), None, [0])
    stored = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del stored["replay"]["max_times_sampled"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(stored))
    run(tmp_path, config(tmp_path), 0, [])  # the default, as the run had
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(stored))
    with pytest.raises(ConfigError, match="replay.max_times_sampled: 0 -> 3"):
        RunRecorder.open(tmp_path, config(tmp_path, "replay.max_times_sampled=3"), 0, log=print)


def edit_config_yaml(run_dir, section, key, value):
    """What a user does by hand in the run dir."""
    stored = yaml.safe_load((run_dir / "config.yaml").read_text())
    stored[section][key] = value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(stored, sort_keys=False))


def test_a_hand_edit_the_checkpoint_overrules_is_named_in_one_line_and_the_file_says_what_runs(tmp_path, capsys):
    """In one warning line, on stderr (as errors are), not in the progress log."""
    run(tmp_path, config(tmp_path), None, range(5))
    trained_with = run_settings(config(tmp_path))  # what the checkpoint at step 4 recorded
    edit_config_yaml(tmp_path, "replay", "samples_per_insert", 4.0)
    capsys.readouterr()
    lines = []
    recorder = RunRecorder.open(tmp_path, config(tmp_path), 4, log=lines.append, trained_with=trained_with)
    recorder.close()
    out, err = capsys.readouterr()
    assert err.splitlines() == [
        f"warning: {tmp_path / 'config.yaml'} was edited: it says replay.samples_per_insert: 4.0, "
        "but the run goes on with replay.samples_per_insert: 2.0, as its checkpoint was trained, and the "
        "file is rewritten to that (a resume cannot change these: use a new run.dir)"]
    assert lines == [] and out == ""
    assert recorder.config.replay.samples_per_insert == 2.0
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["replay"]["samples_per_insert"] == 2.0
    RunRecorder.open(tmp_path, config(tmp_path), 4, log=lines.append, trained_with=trained_with).close()
    assert lines == [] and capsys.readouterr().err == ""  # written back: the next resume has nothing to say


def test_the_edit_with_the_same_value_on_the_command_line_is_a_change_of_the_run_refused(tmp_path):
    run(tmp_path, config(tmp_path), None, range(5))
    trained_with = run_settings(config(tmp_path))
    edit_config_yaml(tmp_path, "replay", "samples_per_insert", 4.0)
    before = files(tmp_path)
    lines = []
    with pytest.raises(ConfigError) as refused:
        RunRecorder.open(tmp_path, config(tmp_path, "replay.samples_per_insert=4"), 4, log=lines.append,
                         trained_with=trained_with)
    assert "replay.samples_per_insert: 2.0 -> 4.0" in str(refused.value) and "\n" not in str(refused.value)
    assert files(tmp_path) == before and lines == []  # nothing written, the edit left as it was, no second line


def test_an_edit_of_a_key_a_resume_may_change_with_the_same_value_on_the_command_line_runs_and_is_recorded(tmp_path):
    run(tmp_path, config(tmp_path), None, range(5))
    edit_config_yaml(tmp_path, "train", "steps", 80)
    recorder, lines = run(tmp_path, config(tmp_path, "train.steps=80"), 4, [5])
    assert recorder.config.train.steps == 80 and lines == []
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["steps"] == 80


def test_summary_is_written_whole_and_read_back(tmp_path):
    assert last_summary(tmp_path) == {}
    recorder, _ = run(tmp_path, config(tmp_path), None, [])
    recorder.summary({"steps": 3, "replay/ratio": 2.0})
    assert recorder.last_summary() == {"steps": 3, "replay/ratio": 2.0}
    assert not list(tmp_path.glob(".*tmp*"))
    (tmp_path / "summary.json").write_text('{"steps": 3, "repl')
    assert last_summary(tmp_path) == {}


def tensorboard_as_shown(run_dir) -> dict[tuple[str, int], list[float]]:
    """(tag, step) -> the scalar values TensorBoard shows: event files read in name order, and a
    SessionLog START at step s hiding the earlier events at step s or later (its purge rule)."""
    from tensorboardX.proto import event_pb2

    shown: dict[tuple[str, int], list[float]] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            i += 12 + n + 4
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                shown = {k: v for k, v in shown.items() if k[1] < event.step}
            for v in event.summary.value:
                shown.setdefault((v.tag, event.step), []).append(v.simple_value)
    return shown


def test_tensorboard_shows_each_step_once_after_a_resume(tmp_path):
    pytest.importorskip("tensorboardX", reason="TensorBoard files need tensorboardX (a default dependency)")
    cfg = config(tmp_path)
    run(tmp_path, cfg, None, range(7), value=1.0)
    run(tmp_path, cfg, 4, range(5, 9), value=100.0)  # in the same second: its own event file all the same
    shown = tensorboard_as_shown(tmp_path)
    assert sorted(step for _, step in shown) == list(range(9))
    assert shown[("loss", 4)] == [5.0] and shown[("loss", 6)] == [106.0]
