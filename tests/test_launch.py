"""The TPU pod launcher: its dry run prints every command a pod run needs, runs none, and
refuses a config the workers would not run, with one line and exit code 2, before any. Against a
fake `gcloud` that logs its arguments, `up --bucket` stores its launch in the bucket and `resume`
recreates the preempted slice and reruns that launch."""

import ast
import json
import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
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


def _worker_command(remote: str) -> tuple[list[str], list[str]]:
    """The train remote's launch/pod_worker.sh words (bash, script, log, logs URL) and the command it runs."""
    words = shlex.split(remote.split("nohup ", 1)[1].split(" > ")[0])
    return words[:4], words[4:]


def _jax_pin(constraints: str) -> str:
    return re.search(r"^jax==(\S+)$", (ROOT / constraints).read_text(), re.MULTILINE).group(1)


def _expected_setup(tier: str) -> list[str]:
    """Every command a worker runs to install the tier, in order: the specification of `install`."""
    python, constraints, package, reverb = {
        "default": ("3.12", "constraints/default.txt", ".", False),
        "sidecar": ("3.12", "constraints/default.txt", ".", False),  # the default tier, and Reverb's sidecar
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
        *(SIDECAR_SETUP if tier == "sidecar" else []),
        f"echo {tier} > .venv/jaxreplay-tier",
    ]


# `make venv-sidecar` on a worker: Python 3.11 from uv (TPU images ship 3.10), the Makefile's pins and packages, then
# the trainer's own search for the sidecar's Python, which fails the install where it finds none.
SIDECAR_SETUP = [
    "~/.jaxreplay-uv/bin/uv venv --seed --python 3.11 .venv-sidecar",
    ".venv-sidecar/bin/python -m pip install --quiet -c constraints/reverb-py311.txt dm-reverb tensorflow-cpu pyyaml",
    """.venv/bin/python -c 'from jaxreplay.replay.sidecar import find_python; print("reverb sidecar:", *find_python())'""",
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
    assert launcher.worker_setup(launcher.SIDECAR) == _expected_setup("sidecar")


def test_the_workers_sidecar_environment_is_the_makefiles():
    """What `make venv-sidecar` installs, and with which pins, is what the workers get (tpu_pod.sidecar_setup)."""
    launcher = _launcher_module()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^SIDECAR_PINS := (\S+)$", makefile, re.MULTILINE).group(1) == launcher.SIDECAR_PINS
    assert "$(call find_python,3.11)" in re.search(r"^SIDECAR_PYTHON \?= (.*)$", makefile, re.MULTILINE).group(1)
    assert launcher.SIDECAR_PYTHON == "3.11"
    (install,) = [line for line in makefile.splitlines() if line.strip().startswith(".venv-sidecar/bin/python -m uv pip")]
    assert install.split("$(SIDECAR_PINS)")[1].split() == list(launcher.SIDECAR_PACKAGES)
    assert _jax_pin("constraints/default.txt").split(".")[:2] >= ["0", "12"]  # the current jax, not the Reverb pin


@pytest.mark.parametrize("backend_override, tier", [
    ([], "default"),  # replay.backend: auto, which is inprocess where Reverb is not installed
    (["replay.backend=inprocess"], "default"),
    (["replay.backend=reverb"], "sidecar"),  # the default tier, Reverb in sidecars
])
def test_dry_run_of_up_installs_the_tier_of_the_configs_backend(bin_dir, backend_override, tier):
    result = _dry_run(bin_dir, *UP, "train.steps=50", *backend_override)
    backend = {"default": "inprocess", "sidecar": "reverb"}[tier]
    try:  # the workers run the config with multi-host on and the backend resolved for their tier
        load_config(ROOT / CONFIG, ["train.steps=50", "distributed.enabled=true", f"replay.backend={backend}"],
                    local=False)
    except ConfigError as e:  # e.g. a backend multi-host cannot use: refused before any command
        assert (result.returncode, result.stdout) == (2, ""), result.stderr
        assert result.stderr.splitlines() == [result.stderr.strip()] and str(e) in result.stderr
        return
    assert result.returncode == 0, result.stderr
    create, state, archive, scp, install, *describe, train = _commands(result)
    assert create == ["gcloud", "compute", "tpus", "queued-resources", "create", "rl", "--node-id=rl",
                      "--accelerator-type=v5litepod-8", "--runtime-version=v2-alpha-tpuv5-lite", "--zone=us-west4-a"]
    assert state == ["gcloud", "compute", "tpus", "queued-resources", "describe", "rl",
                     "--format=value(state.state)", "--zone=us-west4-a"]  # waits until the slice is ACTIVE
    archive_path = os.path.join(tempfile.gettempdir(), "jaxreplay-rl.tar.gz")
    assert archive == ["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--output={archive_path}", "HEAD"]
    assert "scp" in scp and "--worker=all" in scp
    assert "ssh" in install and "--worker=all" in install
    assert _remote(install).split(" && ") == _expected_setup(tier)
    # Every worker starts the same training, on the backend its tier installed.
    assert "--worker=all" in train
    remote = _remote(train)
    assert f"grep -qx {tier} .venv/jaxreplay-tier" in remote  # train refuses a worker installed for another tier
    worker, command = _worker_command(remote)
    assert worker == ["bash", "launch/pod_worker.sh", "~/jaxreplay-train.log", ""]  # no --bucket: no log copies
    assert command[:3] == [".venv/bin/jaxreplay", "train", CONFIG]
    assert command[3] == "run.dir=../jaxreplay-runs/rl"  # each worker's own disk
    overrides = command[3:]
    assert "train.steps=50" in overrides and "distributed.enabled=true" in overrides
    assert [o for o in overrides if o.startswith("replay.backend=")][-1] == f"replay.backend={backend}"
    if tier == "sidecar":  # Reverb lives on worker 0, whose address all get
        (describe,) = describe
        assert "describe" in describe and "--format=value(networkEndpoints[0].ipAddress)" in describe
        assert overrides[-2:] == ["replay.port=9890", "distributed.replay_address=<worker0-ip>:9890"]
    else:
        assert describe == [] and not any(o.startswith("distributed.replay_address") for o in overrides)


@pytest.mark.parametrize("action, expected", [
    ("logs", "ssh rl --worker=0 '--command=tail -n 100 ~/jaxreplay-train.log'"),
    ("stop", "kill $(cat ~/jaxreplay-train.pid)"),
    ("delete", "gcloud compute tpus queued-resources delete rl --force --quiet --zone=us-central2-b"),
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


@pytest.mark.parametrize("tpu", ["v6e-8", "v5e-16"])
def test_reverb_on_any_slice_gets_the_current_jax_and_the_sidecar(bin_dir, tpu):
    """v6e, newer than the Reverb lane's jax 0.4.34, and a multi-host slice, whose other workers' sidecars reach
    worker 0's: the default tier and the sidecar environment, never the Reverb lane."""
    result = _dry_run(bin_dir, "up", "--name", "rl", "--tpu", tpu, "--zone", "us-east5-b", "--config", CONFIG,
                      "replay.backend=reverb", f"mesh.topology={tpu}")
    assert result.returncode == 0, result.stderr
    *_, install, describe, train = _commands(result)
    assert _remote(install).split(" && ") == _expected_setup("sidecar")
    assert "--format=value(networkEndpoints[0].ipAddress)" in describe
    _, command = _worker_command(_remote(train))
    assert command[-3:] == ["replay.backend=reverb", "replay.port=9890", "distributed.replay_address=<worker0-ip>:9890"]


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
    assert len(_commands(with_python)) == 7
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


def test_launcher_and_pod_docs_name_only_configs_that_exist():
    doc = ast.get_docstring(ast.parse(LAUNCHER.read_text()))
    pods = (ROOT / "docs" / "pods.md").read_text()
    named = re.findall(r"configs/[\w.{},-]+\.yaml", doc + pods)
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


# ----------------------------------------------------------------------------------
# For real, against a fake gcloud: a bucket is a folder, the slice a state file


FAKE_GCLOUD = '''#!{python}
"""gcloud as the launcher uses it: logs its arguments; storage on folders; one queued resource's state."""
import json, os, shutil, sys
from pathlib import Path

home = Path(os.environ["FAKE_GCLOUD_HOME"])
args = sys.argv[1:]
with open(home / "calls.jsonl", "a") as log:
    log.write(json.dumps(args) + "\\n")
state = home / "queued-resource"  # its state; absent: deleted (a preempted Spot slice may be either)


def local(url):
    return home / "bucket" / url.removeprefix("gs://")


def fail(message):
    print(message, file=sys.stderr)
    sys.exit(1)


if args[:2] == ["storage", "cp"]:
    src, dst = [a for a in args[2:] if not a.startswith("--")]
    local(dst).parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, local(dst))
elif args[:2] == ["storage", "cat"]:
    if not local(args[2]).is_file():
        fail(f"ERROR: (gcloud.storage.cat) The following URLs matched no objects or files:\\n-{{args[2]}}")
    sys.stdout.write(local(args[2]).read_text())
elif args[:3] == ["compute", "tpus", "queued-resources"]:
    if args[3] != "create" and not state.exists():
        fail(f"ERROR: (gcloud.compute.tpus.queued-resources.{{args[3]}}) NOT_FOUND: {{args[4]}} was not found")
    if args[3] == "create":
        state.write_text("ACTIVE")
    elif args[3] == "delete":
        state.unlink()
    elif args[3] == "describe":
        print(state.read_text())
'''

SPOT_UP = [*UP, "--bucket", "gs://rl-runs", "--spot", "train.steps=50"]


@pytest.fixture
def fake_gcloud(tmp_path) -> Path:
    """Its home: calls.jsonl (every call's arguments), bucket/ (gs://), queued-resource (the slice's state)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD.format(python=sys.executable))
    (bin_dir / "gcloud").chmod(0o755)
    (bin_dir / "git").symlink_to(shutil.which("git"))
    return tmp_path


def _launch(home: Path, *args: str) -> subprocess.CompletedProcess:
    """The launcher for real, with the fake gcloud first on PATH and its archive under `home`."""
    env = {**os.environ, "PATH": f"{home / 'bin'}:{os.path.dirname(sys.executable)}:/usr/bin:/bin",
           "FAKE_GCLOUD_HOME": str(home), "TMPDIR": str(home)}
    return subprocess.run([sys.executable, str(LAUNCHER), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _calls(home: Path) -> list[list[str]]:
    path = home / "calls.jsonl"
    calls = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    path.unlink(missing_ok=True)
    return calls


QR = ["compute", "tpus", "queued-resources"]
ZONE = "--zone=us-west4-a"
CREATE = [*QR, "create", "rl", "--node-id=rl", "--accelerator-type=v5litepod-8",
          "--runtime-version=v2-alpha-tpuv5-lite", ZONE, "--spot"]
DESCRIBE = [*QR, "describe", "rl", "--format=value(state.state)", ZONE]


def _shipped(home: Path) -> list[list[str]]:
    """The install calls after the archive: scp to every worker, then the default tier's setup on each."""
    archive = str(home / "jaxreplay-rl.tar.gz")
    return [["compute", "tpus", "tpu-vm", "scp", archive, "rl:jaxreplay.tar.gz", "--worker=all", ZONE],
            ["compute", "tpus", "tpu-vm", "ssh", "rl", "--worker=all",
             "--command=" + " && ".join(_expected_setup("default")), ZONE]]


@pytest.mark.parametrize("preempted", ["SUSPENDED", "deleted"])
def test_up_stores_its_launch_in_the_bucket_and_resume_reruns_it_on_a_new_slice(fake_gcloud, preempted):
    home = fake_gcloud
    up = _launch(home, *SPOT_UP)
    assert up.returncode == 0, up.stderr
    store, *calls = _calls(home)
    assert store[:2] == ["storage", "cp"] and store[-1] == "gs://rl-runs/runs/rl/launch.json"  # before the slice
    train_call = calls[-1]
    assert calls == [CREATE, DESCRIBE, *_shipped(home), train_call]
    remote = _remote(train_call)
    worker, command = _worker_command(remote)
    assert worker == ["bash", "launch/pod_worker.sh", "~/jaxreplay-train.log", "gs://rl-runs/runs/rl/logs"]
    assert command == [".venv/bin/jaxreplay", "train", CONFIG, "run.dir=gs://rl-runs/runs/rl", "run.progress_bar=false",
                       "train.steps=50", "distributed.enabled=true", "replay.backend=inprocess"]
    record = json.loads((home / "bucket" / "rl-runs" / "runs" / "rl" / "launch.json").read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          timeout=60).stdout.strip()
    assert (record["commit"], record["command"], record["tpu"], record["spot"]) == (head, command, "v5e-8", True)

    # A preemption: the queued resource is SUSPENDED (its name still taken), or gone.
    if preempted == "deleted":
        (home / "queued-resource").unlink()
    else:
        (home / "queued-resource").write_text("SUSPENDED")
    (home / "jaxreplay-rl.tar.gz").unlink()
    resumed = _launch(home, "resume", "--name", "rl", "--bucket", "gs://rl-runs")
    assert resumed.returncode == 0, resumed.stderr
    delete = [[*QR, "delete", "rl", "--force", "--quiet", ZONE]] if preempted == "SUSPENDED" else []
    assert _calls(home) == [["storage", "cat", "gs://rl-runs/runs/rl/launch.json"], DESCRIBE, *delete, CREATE, DESCRIBE,
                            *_shipped(home), train_call]
    shipped = subprocess.run(["tar", "-tzf", str(home / "jaxreplay-rl.tar.gz")], capture_output=True, text=True,
                             timeout=60).stdout.split()
    assert CONFIG in shipped and "launch/pod_worker.sh" in shipped  # the stored commit's tree


def test_resume_refuses_a_live_slice_and_a_bucket_without_a_launch(fake_gcloud):
    home = fake_gcloud
    missing = _launch(home, "resume", "--name", "rl", "--bucket", "gs://rl-runs")
    assert missing.returncode == 2 and len(missing.stderr.splitlines()) == 1, missing.stderr
    assert "gs://rl-runs/runs/rl/launch.json" in missing.stderr and "up --bucket" in missing.stderr
    assert _calls(home) == [["storage", "cat", "gs://rl-runs/runs/rl/launch.json"]]
    assert _launch(home, *SPOT_UP).returncode == 0
    _calls(home)
    live = _launch(home, "resume", "--name", "rl", "--bucket", "gs://rl-runs")
    assert live.returncode == 2 and "ACTIVE" in live.stderr and len(live.stderr.splitlines()) == 1, live.stderr
    assert _calls(home) == [["storage", "cat", "gs://rl-runs/runs/rl/launch.json"], DESCRIBE]  # nothing created


@pytest.mark.parametrize("tpu", ["v5e-16", "v4-8"])
def test_a_slice_other_than_the_configs_topology_is_refused_before_anything_is_created(fake_gcloud, tpu):
    home = fake_gcloud
    result = _launch(home, "up", "--name", "rl", "--tpu", tpu, "--zone", "us-west4-a", "--config", CONFIG,
                     "--bucket", "gs://rl-runs", "--spot")
    _refused(result, f"--tpu {tpu}", "mesh.topology: v5e-8")
    assert _calls(home) == []


def test_a_bucket_that_is_not_a_gs_url_is_refused(bin_dir):
    _refused(_dry_run(bin_dir, *UP, "--bucket", "/mnt/runs"), "--bucket /mnt/runs", "gs://")


def test_the_worker_script_copies_the_log_to_the_bucket_and_keeps_the_commands_status(fake_gcloud):
    home = fake_gcloud
    env = {**os.environ, "PATH": f"{home / 'bin'}:/usr/bin:/bin", "FAKE_GCLOUD_HOME": str(home)}
    log = home / "train.log"
    result = subprocess.run(["bash", str(ROOT / "launch" / "pod_worker.sh"), str(log), "gs://rl-runs/runs/rl/logs",
                             "sh", "-c", "echo step 1; echo oops >&2; exit 3"], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 3, result.stderr
    host = subprocess.run(["hostname"], capture_output=True, text=True, timeout=10).stdout.strip()
    assert _calls(home) == [["storage", "cp", "--quiet", str(log), f"gs://rl-runs/runs/rl/logs/{host}.log"]]
    assert (home / "bucket" / "rl-runs" / "runs" / "rl" / "logs" / f"{host}.log").read_text() == "step 1\noops\n"
