"""The TPU pod launcher: its dry run prints every command a pod run needs, runs none, and
refuses a config the workers would not run, with one line and exit code 2, before any."""

import ast
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxreplay.config import ConfigError, load_config
from jaxreplay.models.sharding import mesh_shape
from jaxreplay.models.transformer import abstract_params, count_params

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "launch" / "tpu_pod.py"
CONFIG = "configs/pod_v5e-8_qwen2.5_0.5b.yaml"
UP = ["up", "--name", "rl", "--tpu", "v5e-8", "--zone", "us-west4-a", "--config", CONFIG]
LIBTPU = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"


@pytest.fixture(scope="module")
def bin_dir(tmp_path_factory) -> Path:
    """PATH for the dry runs: git and this Python, no gcloud (a dry run must not need it)."""
    path = tmp_path_factory.mktemp("bin")
    (path / "git").symlink_to(shutil.which("git"))
    return path


def _dry_run(bin_dir: Path, *args: str, python: tuple = (sys.executable,)) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{bin_dir}:{os.path.dirname(sys.executable)}"}
    return subprocess.run([*python, str(LAUNCHER), "--dry-run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def _commands(result: subprocess.CompletedProcess) -> list[list[str]]:
    lines = result.stdout.splitlines()
    assert all(line.startswith("+ ") for line in lines), result.stdout
    return [shlex.split(line[2:]) for line in lines]


def _remote(cmd: list[str]) -> str:
    (remote,) = [word[len("--command="):] for word in cmd if word.startswith("--command=")]
    return remote


def _jax_pin(constraints: str) -> str:
    return re.search(r"^jax==(\S+)$", (ROOT / constraints).read_text(), re.MULTILINE).group(1)


def _expected_setup(tier: str) -> list[str]:
    """Every command a worker runs to install the tier, in order: the specification of `install`."""
    python, constraints, package, reverb = {
        "default": ("3.12", "constraints/default.txt", ".", False),
        "reverb": ("3.11", "constraints/reverb-py311.txt", ".[reverb]", True),
    }[tier]
    jax = _jax_pin(constraints)
    major, minor = python.split(".")
    check = "; ".join([
        "import sys, jax, jaxreplay" + (", reverb" if reverb else ""),
        f"assert sys.version_info[:2] == ({major}, {minor}), sys.version",
        f'assert jax.__version__ == "{jax}", jax.__version__',
        'assert jax.local_devices()[0].platform == "tpu", jax.local_devices()',
        'print("python", sys.version.split()[0], "jax", jax.__version__, jax.local_device_count(), "tpu chips")',
    ])
    pip = [".venv/bin/python", "-m", "pip", "install", "--quiet", "-c", constraints, "-e", package,
           f"jax[tpu]=={jax}", *(["-f", LIBTPU] if reverb else [])]
    return [
        "sudo apt-get update -qq",
        "sudo apt-get install -y -qq python3-venv",
        "python3 -m venv ~/.jaxreplay-uv",
        "~/.jaxreplay-uv/bin/pip install --quiet uv==0.13.9",
        "rm -rf ~/jaxreplay",
        "mkdir -p ~/jaxreplay",
        "tar -xzf ~/jaxreplay.tar.gz -C ~/jaxreplay",
        "cd ~/jaxreplay",
        f"~/.jaxreplay-uv/bin/uv venv --seed --python {python} .venv",
        shlex.join(pip),
        shlex.join([".venv/bin/python", "-c", check]),
        f"echo {tier} > .venv/jaxreplay-tier",
    ]


def _launcher_module():
    spec = importlib.util.spec_from_file_location("tpu_pod", LAUNCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_tier_installs_its_python_constraints_and_jax_tpu():
    launcher = _launcher_module()
    assert launcher.worker_setup(launcher.DEFAULT) == _expected_setup("default")
    assert launcher.worker_setup(launcher.REVERB) == _expected_setup("reverb")
    assert _jax_pin("constraints/default.txt").split(".")[:2] >= ["0", "12"]  # the current jax, not the Reverb pin


@pytest.mark.parametrize("backend_override, tier", [
    ([], "default"),  # replay.backend: auto, which is inprocess where Reverb is not installed
    (["replay.backend=inprocess"], "default"),
    (["replay.backend=reverb"], "reverb"),
])
def test_dry_run_of_up_installs_the_tier_of_the_configs_backend(bin_dir, backend_override, tier):
    result = _dry_run(bin_dir, *UP, "train.steps=50", *backend_override)
    backend = {"default": "inprocess", "reverb": "reverb"}[tier]
    try:  # the workers run the config with multi-host on and the backend resolved for their tier
        load_config(ROOT / CONFIG, ["train.steps=50", "distributed.enabled=true", f"replay.backend={backend}"],
                    local=False)
    except ConfigError as e:  # e.g. a backend multi-host cannot use: refused before any command
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        assert result.stderr.splitlines() == [result.stderr.strip()] and str(e) in result.stderr
        return
    assert result.returncode == 0, result.stderr
    create, archive, scp, install, *describe, train = _commands(result)
    assert create[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "create", "rl"]
    assert "--accelerator-type=v5litepod-8" in create and "--version=v2-alpha-tpuv5-lite" in create
    assert "--zone=us-west4-a" in create
    assert archive == ["git", "-C", str(ROOT), "archive", "--format=tar.gz", "--output=/tmp/jaxreplay-rl.tar.gz",
                       "HEAD"]
    assert "scp" in scp and "--worker=all" in scp
    assert "ssh" in install and "--worker=all" in install
    assert _remote(install).split(" && ") == _expected_setup(tier)
    # Every worker starts the same training, on the backend its tier installed.
    assert "--worker=all" in train
    remote = _remote(train)
    assert f"grep -qx {tier} .venv/jaxreplay-tier" in remote  # train refuses a worker installed for another tier
    command = shlex.split(remote.split("nohup ", 1)[1].split(" > ")[0])
    assert command[:3] == [".venv/bin/jaxreplay", "train", CONFIG]
    overrides = command[3:]
    assert "train.steps=50" in overrides and "distributed.enabled=true" in overrides
    assert [o for o in overrides if o.startswith("replay.backend=")][-1] == f"replay.backend={backend}"
    if tier == "reverb":  # Reverb lives on worker 0, whose address all get
        (describe,) = describe
        assert "describe" in describe and "--format=value(networkEndpoints[0].ipAddress)" in describe
        assert overrides[-2:] == ["replay.port=9890", "distributed.replay_address=<worker0-ip>:9890"]
    else:
        assert describe == [] and not any(o.startswith("distributed.replay_address") for o in overrides)


@pytest.mark.parametrize("action, expected", [
    ("logs", "ssh rl --worker=0 '--command=tail -n 100 ~/jaxreplay-train.log'"),
    ("stop", "kill $(cat ~/jaxreplay-train.pid)"),
    ("delete", "gcloud compute tpus tpu-vm delete rl --quiet --zone=us-central2-b"),
])
def test_dry_run_of_the_other_actions(bin_dir, action, expected):
    result = _dry_run(bin_dir, action, "--name", "rl", "--tpu", "v4-8", "--zone", "us-central2-b")
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


def _refused(result: subprocess.CompletedProcess, *words: str) -> None:
    """One line on stderr naming `words`, exit code 2, and no command printed."""
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith("tpu_pod: "), result.stderr
    for word in words:
        assert word in result.stderr


def test_a_bad_override_fails_before_any_command(bin_dir):
    _refused(_dry_run(bin_dir, *UP, "replay.backend=reverb", "train.batch_size=0"), "train.batch_size")


def test_reverb_on_a_slice_newer_than_the_reverb_lanes_jax_is_refused(bin_dir):
    result = _dry_run(bin_dir, "up", "--name", "rl", "--tpu", "v6e-8", "--zone", "us-east5-b", "--config", CONFIG,
                      "replay.backend=reverb")
    _refused(result, "reverb", "v6e")


@pytest.mark.parametrize("action", ["up", "install", "train"])
def test_a_config_outside_the_repository_is_refused_in_one_line(bin_dir, tmp_path, action):
    outside = tmp_path / "pod.yaml"
    shutil.copyfile(ROOT / CONFIG, outside)
    _refused(_dry_run(bin_dir, action, *UP[1:-1], str(outside)), str(outside), "outside the repository")


def test_a_missing_config_is_refused_in_one_line(bin_dir):
    _refused(_dry_run(bin_dir, *UP[:-1], "configs/no_such_pod.yaml"), "configs/no_such_pod.yaml")


def test_a_config_never_committed_is_refused_since_the_workers_would_not_get_it(bin_dir):
    untracked = ROOT / "configs" / f"test_launch_untracked_{os.getpid()}.yaml"
    shutil.copyfile(ROOT / CONFIG, untracked)
    try:
        result = _dry_run(bin_dir, *UP[:-1], str(untracked.relative_to(ROOT)), "replay.backend=reverb")
    finally:
        untracked.unlink()
    _refused(result, untracked.name, "not committed")


def test_a_config_changed_since_the_last_commit_is_refused(bin_dir):
    path = ROOT / CONFIG
    text = path.read_text()
    try:
        path.write_text(text + "# an uncommitted edit\n")
        result = _dry_run(bin_dir, *UP, "replay.backend=reverb")
    finally:
        path.write_text(text)
    _refused(result, CONFIG, "uncommitted changes")


def test_dry_run_needs_no_pyyaml_in_the_python_that_runs_it(bin_dir):
    """`python -S` sees no site-packages (no pyyaml, no numpy): the launcher re-runs itself under
    `--python`, or the checkout's .venv/bin/python, or says in one line what it needs."""
    bare = (sys.executable, "-S")
    with_python = _dry_run(bin_dir, *UP, "replay.backend=reverb", "--python", sys.executable, python=bare)
    assert with_python.returncode == 0, with_python.stderr
    assert len(_commands(with_python)) == 6
    default = _dry_run(bin_dir, *UP, "replay.backend=reverb", python=bare)
    if (ROOT / ".venv" / "bin" / "python").exists():  # made by `make demo` / `make test`
        assert (default.returncode, default.stdout) == (0, with_python.stdout), default.stderr
    else:
        _refused(default, "pyyaml", "make demo", "--python")


def test_a_python_that_cannot_check_the_config_is_refused_in_one_line(bin_dir, tmp_path):
    _refused(_dry_run(bin_dir, *UP, "--python", str(tmp_path / "python3")), "--python", "no such executable")
    bare = tmp_path / "bare-python"  # runs, but without site-packages: no pyyaml
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    _refused(_dry_run(bin_dir, *UP, "--python", str(bare)), str(bare), "lacks jaxreplay's requirements")


def test_launcher_and_readme_name_only_configs_that_exist():
    doc = ast.get_docstring(ast.parse(LAUNCHER.read_text()))
    readme = (ROOT / "README.md").read_text()
    pod_section = readme.split("## Multi-host and TPU pods", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"configs/[\w.{},-]+\.yaml", doc + pod_section)
    assert named
    for name in named:
        expanded = [name]
        while any("{" in n for n in expanded):  # configs/pod_{a,b}_x.yaml -> each
            n = next(n for n in expanded if "{" in n)
            head, options, tail = re.match(r"(.*?)\{([^}]*)\}(.*)", n).groups()
            expanded = [m for m in expanded if m != n] + [head + o + tail for o in options.split(",")]
        for path in expanded:
            assert (ROOT / path).is_file(), path


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
