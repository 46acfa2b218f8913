"""The TPU pod launcher: its dry run prints every gcloud command a pod run needs, and runs none."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxreplay.config import load_config
from jaxreplay.models import abstract_params, count_params
from jaxreplay.sharding import mesh_shape

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "tpu_pod.py"
CONFIG = "configs/pod_v5e-8_qwen2.5_0.5b.yaml"


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable)}  # no gcloud: the dry run must not need it
    return subprocess.run([sys.executable, str(LAUNCHER), "--dry-run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_of_up_prints_create_install_and_train_on_every_worker():
    result = _dry_run("up", "--name", "rl", "--tpu", "v5e-8", "--zone", "us-west4-a", "--config", CONFIG,
                      "train.steps=50")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith("+ ") for line in lines)
    create, archive, scp, install, describe, train = lines
    assert "gcloud compute tpus tpu-vm create rl --accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite" in create
    assert "--zone=us-west4-a" in create
    assert "git -C" in archive and "archive" in archive and "HEAD" in archive
    assert "scp" in scp and "--worker=all" in scp
    # jax[tpu] pinned to exactly the jax in pyproject.toml.
    jax_pin = re.search(r'"jax==([0-9.]+)"', (ROOT / "pyproject.toml").read_text()).group(1)
    assert "--worker=all" in install and f"jax[tpu]=={jax_pin}" in install and "libtpu_releases" in install
    assert "describe rl" in describe and "networkEndpoints[0].ipAddress" in describe
    # Every worker starts the same training; Reverb lives on worker 0, whose address all get.
    assert "ssh rl --worker=all" in train
    for part in [f"jaxreplay train {CONFIG}", "distributed.enabled=true", "replay.port=9890",
                 "distributed.replay_address=<worker0-ip>:9890", "train.steps=50", "nohup"]:
        assert part in train, part


@pytest.mark.parametrize("action, expected", [
    ("logs", "ssh rl --worker=0 '--command=tail -n 100 ~/jaxreplay-train.log'"),
    ("stop", "kill $(cat ~/jaxreplay-train.pid)"),
    ("delete", "gcloud compute tpus tpu-vm delete rl --quiet --zone=us-central2-b"),
])
def test_dry_run_of_the_other_actions(action, expected):
    result = _dry_run(action, "--name", "rl", "--tpu", "v4-8", "--zone", "us-central2-b")
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


def test_a_bad_override_fails_before_any_command():
    result = _dry_run("up", "--name", "rl", "--tpu", "v4-8", "--zone", "us-central2-b", "--config", CONFIG,
                      "train.batch_size=0")
    assert result.returncode != 0 and result.stdout == ""
    assert "train.batch_size" in result.stderr


@pytest.mark.parametrize("name, chips, params", [
    ("pod_v5e-8_qwen2.5_0.5b", 8, 494_032_768),
    ("pod_v5e-8_qwen2.5_1.5b", 8, 1_543_714_304),
    ("pod_v4-8_qwen2.5_0.5b", 4, 494_032_768),
    ("pod_v4-8_qwen2.5_1.5b", 4, 1_543_714_304),
])
def test_pod_configs_are_qwen_shaped_and_fit_their_slice(name, chips, params):
    config = load_config(ROOT / "configs" / f"{name}.yaml")
    assert count_params(abstract_params(config.model)) == params  # Qwen2.5-0.5B / -1.5B exactly
    data, fsdp, tensor = mesh_shape(config.mesh, chips)
    assert data * fsdp * tensor == chips
    assert config.train.batch_size % (data * fsdp) == 0 and config.rollouts_per_step % (data * fsdp) == 0
    assert config.distributed.enabled
