"""Disaggregated training end to end: actor mesh and learner mesh on disjoint host devices.

Needs 4 devices, fixed before JAX initialises: tests/test_disaggregated.py runs this
file in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=4.
"""

import json
import threading
import time

import jax
import pytest

from jaxreplay.config import load_config
from jaxreplay.models import sharding
from jaxreplay.tasks import rewards
from jaxreplay.train.driver import train
from jaxreplay.train.roles import RoleError

pytestmark = pytest.mark.skipif(jax.device_count() != 4, reason="needs 4 devices: run through test_disaggregated.py")

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
         "model.d_ff=64", "warmstart.steps=0", "run.progress_bar=false", "mesh.actor_devices=2", "mesh.data=-1",
         "train.batch_size=16", "train.prompts_per_step=2", "replay.max_size=128", "replay.min_size_to_sample=32"]
STEPS, K, SPI = 100, 3, 2.0


def test_meshes_are_disjoint_and_cover_the_devices():
    config = load_config(None, SMALL)
    actor, learner = sharding.make_role_meshes(config.mesh)
    a, b = set(actor.devices.flat), set(learner.devices.flat)
    assert not a & b and a | b == set(jax.devices()) and len(a) == 2


def test_limiter_holds_the_ratio_and_rollouts_carry_the_pushed_versions(tmp_path):
    config = load_config(None, SMALL + [f"train.steps={STEPS}", f"train.weight_sync_every={K}",
                                        f"replay.samples_per_insert={SPI}", f"run.dir={tmp_path}"])
    summary = train(config, log=lambda _: None)
    assert summary["steps"] == STEPS
    assert summary["replay/samples"] == STEPS * config.train.batch_size
    assert summary["replay/ratio"] == pytest.approx(SPI, rel=0.10)
    assert summary["weights/pushes"] == -(-STEPS // K)  # every K steps and after the last
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "eval/accuracy" in rows[0] and rows[0]["step"] == 0  # the policy before any update
    rows = rows[1:]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # the actor only ever holds weights the learner pushed: versions 0, K, 2K, ...
        assert r["batch/version_min"] % K == 0 and r["batch/version_max"] % K == 0
        assert r["batch/version_max"] <= r["step"] - 1
    assert max(r["batch/version_max"] for r in rows) > 0  # pushed weights did reach the actor
    assert json.loads((tmp_path / "summary.json").read_text())["replay/ratio"] == summary["replay/ratio"]


def test_lora_trains_disaggregated_with_adapter_only_weight_updates(tmp_path):
    """LoRA across two meshes: the actor gets the base once and then the adapters at each push
    (rollout/weights.py); the rollouts carry the pushed versions as without LoRA."""
    steps = 12
    config = load_config(None, SMALL + [f"train.steps={steps}", f"train.weight_sync_every={K}", "train.eval_every=1000",
                                        "model.lora.targets=[q_proj,v_proj,up_proj]", "model.lora.rank=4",
                                        # AsymRE: a non-zero advantage on a random policy's all-wrong groups
                                        "train.loss=asymre", "train.advantage=group_centered", f"run.dir={tmp_path}"])
    summary = train(config, log=lambda _: None)
    assert summary["steps"] == steps and summary["weights/pushes"] == -(-steps // K)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert all(r["batch/version_max"] % K == 0 for r in rows) and max(r["batch/version_max"] for r in rows) > 0
    assert any(r["grad_norm"] > 0 for r in rows)


def test_a_stalled_learner_wait_stops_both_threads_and_reports_the_timeout(tmp_path, monkeypatch):
    """The actor's first reward holds until the learner thread has ended, so nothing is ever
    inserted and the learner's 0.3 s wait for its first batch runs out, however fast the
    actor compiles and decodes (a warm compilation cache once let it fill the table in
    time); then the actor stops too."""
    def learner_alive() -> bool:
        return any(t.name == "learner" and t.is_alive() for t in threading.enumerate())

    def held(completion, reference):
        deadline = time.monotonic() + 120  # bounded: a broken run fails the test, never hangs it
        while learner_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        return 0.0

    monkeypatch.setitem(rewards.REWARDS, "held", held)
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n")
    config = load_config(None, SMALL + ["task.name=jsonl", f"task.path={tmp_path}/{{split}}.jsonl",
                                        "task.reward=held", "task.max_prompt_len=8", "model.vocab_size=260",
                                        "replay.timeout_s=0.3", "train.steps=5", f"run.dir={tmp_path / 'run'}"])
    start = time.monotonic()
    with pytest.raises(RoleError, match=r"learner thread failed: ReplayTimeoutError: waited 0.3s for a batch of 16"):
        train(config, log=lambda _: None)
    assert time.monotonic() - start < 60
    assert not learner_alive() and not any(t.name == "actor" and t.is_alive() for t in threading.enumerate())


def test_released_weights_and_a_calibrated_ratio_train_on_the_disaggregated_meshes(tmp_path):
    """model.hf_path and replay.calibrate_steps work here as colocated: the run trains the HF
    model's architecture and weights, and its limiter runs at the measured ratio."""
    import yaml
    from tiny_hf import write_model

    write_model(tmp_path / "hf")
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8)))
    config = load_config(None, [
        f"model.hf_path={tmp_path / 'hf'}", "model.max_seq_len=48", "task.name=jsonl",
        f"task.path={tmp_path}/{{split}}.jsonl", "task.reward=exact_match", "task.chat_template=true",
        "task.max_prompt_len=40", "sampling.max_new_tokens=2", "warmstart.steps=0", "run.progress_bar=false",
        "mesh.actor_devices=2", "mesh.data=-1", "train.batch_size=16", "train.prompts_per_step=2",
        "replay.max_size=64", "replay.min_size_to_sample=16", "replay.calibrate_steps=1", "train.steps=3",
        f"run.dir={tmp_path / 'run'}"])
    lines = []
    assert train(config, log=lines.append)["steps"] == 3
    assert any(line.startswith(f"loaded {tmp_path / 'hf'}") for line in lines)
    assert any(line.startswith("calibration: mu ") for line in lines)
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    calibration = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert recorded["model"]["d_model"] == 32 and recorded["model"]["hf_path"] == str(tmp_path / "hf")
    assert recorded["replay"]["samples_per_insert"] == calibration["samples_per_insert"]


@pytest.mark.parametrize("overrides", [["replay.positive_fraction=0.25"],
                                       ["replay.max_times_sampled=2", "replay.samples_per_insert=1"]],
                         ids=["positive_bias", "max_times_sampled"])
def test_the_replay_policies_run_on_the_disaggregated_meshes(tmp_path, overrides):
    config = load_config(None, SMALL + ["train.steps=6", f"run.dir={tmp_path}", *overrides])
    summary = train(config, log=lambda _: None)
    assert summary["steps"] == 6 and summary["replay/samples"] >= 6 * config.train.batch_size


def test_max_age_and_fresh_anchors_on_the_disaggregated_meshes(tmp_path):
    """The learner evicts before each sample: no batch holds a row more than max_age versions old."""
    config = load_config(None, SMALL + ["train.steps=12", f"run.dir={tmp_path}", "replay.backend=inprocess",
                                        "replay.max_age=3", "replay.fresh_fraction=0.25"])
    summary = train(config, log=lambda _: None)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()][1:]
    assert summary["steps"] == 12 and summary["replay/samples"] == 12 * (16 - 4)
    assert max(r["staleness/max"] for r in rows) <= 3 and rows[-1]["replay/evicted"] > 0
