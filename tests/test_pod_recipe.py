"""The pod recipe (docs/pods.md) is what the tests run: its `jaxreplay compile`, launcher and SkyPilot
commands; launch/skypilot.yaml as SkyPilot itself reads it; the pod configs it names; and the pod
config shrunk to a tiny model, trained on CPU with the recipe's layout of model, data and run dir."""

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gcs_emulator import bucket, gcs_emulator  # noqa: F401 - fixtures
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "pods.md"
TASK_FILE = ROOT / "launch" / "skypilot.yaml"
BUCKET = "gs://my-jaxreplay-runs"  # the page's `export BUCKET=...`
GSM8K_CONFIGS = {"configs/pod_v5e-8_qwen2.5_0.5b_gsm8k.yaml": "v5e-8",
                 "configs/pod_v5e-16_qwen2.5_0.5b_gsm8k.yaml": "v5e-16"}
SKY_PYTHON = ROOT / ".venv-skypilot" / "bin" / "python"
needs_skypilot = pytest.mark.skipif(not SKY_PYTHON.exists(),
                                    reason="SkyPilot lives in its own venv: make venv-skypilot (.venv-skypilot)")


def _launcher():
    spec = importlib.util.spec_from_file_location("tpu_pod", ROOT / "launch" / "tpu_pod.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAUNCHER = _launcher()


def recipe_paths(root: str, model: str) -> list[str]:
    """Where the recipe reads the model and the data under one root (the bucket; a folder here)."""
    return [f"model.hf_path={root}/models/{model}", f"task.path={root}/data/gsm8k/main/{{split}}-*.parquet"]


def _doc_commands(program: str) -> list[list[str]]:
    """The page's shell lines that run `program` (a path ending), split as bash would with $BUCKET set."""
    text = DOC.read_text()
    assert re.search(r"^export BUCKET=(\S+)$", text, re.MULTILINE).group(1) == BUCKET
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            for part in line.split(" && "):
                words = shlex.split(part.replace("$BUCKET", BUCKET))
                if words and words[0] == "python" and len(words) > 1:
                    words = words[1:]
                if words and words[0].endswith(program):
                    commands.append(words)
    return commands


def _raw(config: str) -> dict:
    return yaml.safe_load((ROOT / config).read_text())


def _task_file(bucket: str = None) -> dict:
    task = yaml.safe_load(TASK_FILE.read_text())
    if bucket is not None:
        task["envs"]["BUCKET"] = bucket
    return task


# ----------------------------------------------------------------------------------
# The configs


def test_pod_configs_name_no_distributed_address():
    """On a TPU VM JAX finds the coordinator, the process count and its own id itself."""
    pods = sorted(ROOT.glob("configs/pod_*.yaml"))
    assert len(pods) >= 7
    for path in pods:
        distributed = yaml.safe_load(path.read_text()).get("distributed", {})
        assert set(distributed) <= {"enabled", "timeout_s", "heartbeat_timeout_s"}, path.name


def test_pod_configs_checkpoint_by_time_as_well_as_by_steps():
    """A learner step of a real model lasts minutes: a preemption without notice loses at most every_seconds."""
    for path in sorted(ROOT.glob("configs/pod_*.yaml")):
        assert 0 < yaml.safe_load(path.read_text())["checkpoint"]["every_seconds"] <= 900, path.name


def test_the_recipe_configs_read_the_model_and_data_from_the_command_line(tmp_path):
    from tiny_hf import write_model

    from jaxreplay.config import ConfigError, load_config

    model = write_model(tmp_path / "model")
    for config, slice_name in GSM8K_CONFIGS.items():
        with pytest.raises(ConfigError, match="model.hf_path"):
            load_config(ROOT / config)  # the chat template needs the model's tokenizer
        loaded = load_config(ROOT / config, [f"model.hf_path={model}", f"task.path={tmp_path}/{{split}}-*.parquet"])
        assert loaded.mesh.topology == slice_name and loaded.task.name == "gsm8k" and loaded.distributed.enabled
        assert loaded.checkpoint.every_seconds > 0


# ----------------------------------------------------------------------------------
# The page's commands


def test_the_recipe_compiles_each_gsm8k_config_for_its_own_slice():
    compiles = _doc_commands("jaxreplay")
    assert [words[1] for words in compiles] == ["compile", "compile"]
    named = {words[2]: words[words.index("--topology") + 1] for words in compiles}
    assert named == GSM8K_CONFIGS
    for config, slice_name in named.items():
        assert _raw(config)["mesh"]["topology"] == slice_name


def _dry_run(words: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.path.dirname(shutil.which('git'))}"}
    return subprocess.run([sys.executable, *words, "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def _launcher_train(stdout: str) -> list[str]:
    """The jaxreplay command a dry run of `up` starts on every worker."""
    train = shlex.split(stdout.splitlines()[-1][2:])
    (remote,) = [word[len("--command="):] for word in train if word.startswith("--command=")]
    return shlex.split(remote.split("nohup ", 1)[1].split(" > ")[0])[4:]


def test_the_recipes_launcher_commands_pass_its_checks():
    commands = _doc_commands("launch/tpu_pod.py")
    actions = [words[1] for words in commands]
    assert actions == ["up", "up", "resume", "delete"]
    for words in commands:
        args = LAUNCHER._parser().parse_intermixed_args(words[1:])
        assert args.bucket in (None, BUCKET)
        if args.action != "up":
            continue
        assert args.spot and args.bucket == BUCKET and GSM8K_CONFIGS[args.config] == args.tpu
        result = _dry_run(words)
        assert result.returncode == 0, result.stderr
        command = _launcher_train(result.stdout)
        assert command == [".venv/bin/jaxreplay", "train", args.config, f"run.dir={BUCKET}/runs/{args.name}",
                           "run.progress_bar=false", *recipe_paths(BUCKET, "Qwen2.5-0.5B-Instruct"),
                           "distributed.enabled=true", "replay.backend=inprocess"]
    assert commands[2][commands[2].index("--name") + 1] == commands[0][commands[0].index("--name") + 1]


def test_the_task_files_setup_installs_what_the_launcher_installs():
    """The default tier, as launch/tpu_pod.py's install gives it, minus shipping the tree (SkyPilot syncs it); then
    the sidecar environment, exactly as the launcher installs it, only where the config names Reverb."""
    setup = [line.strip() for line in _task_file()["setup"].splitlines() if line]
    shipping = ("rm -rf ~/jaxreplay", "mkdir -p", "tar -xzf", "cd ~/jaxreplay", "echo default")
    expected = [line for line in LAUNCHER.worker_setup(LAUNCHER.DEFAULT) if not line.startswith(shipping)]
    assert setup == ["set -euo pipefail", "rm -rf .venv .venv-sidecar", *expected, _backend_line("setup"),
                     'if [ "$backend" = reverb ]; then', *LAUNCHER.sidecar_setup(), "fi"]
    assert _backend_line("setup") == _backend_line("run")  # both decide alike


def _backend_line(part: str) -> str:
    (line,) = [line.strip() for line in _task_file()[part].splitlines() if line.strip().startswith("backend=")]
    return line


def _run_on_a_host(tmp_path: Path, args: str = "") -> tuple[str, list[str]]:
    """`run` executed by bash as SkyPilot runs it on a host, with a stand-in jaxreplay that records its
    arguments and this Python as the host's .venv/bin/python: its banner line and jaxreplay's arguments."""
    task = _task_file(BUCKET)
    (tmp_path / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
    (tmp_path / "configs").mkdir(exist_ok=True)
    shutil.copyfile(ROOT / task["envs"]["CONFIG"], tmp_path / task["envs"]["CONFIG"])
    for name, body in (("jaxreplay", f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "),
                       ("python", f"{sys.executable} ")):
        stand_in = tmp_path / ".venv" / "bin" / name
        stand_in.write_text(f'#!/bin/sh\nexec {body}"$@"\n')
        stand_in.chmod(0o755)
    env = {"PATH": os.environ["PATH"], **task["envs"], "ARGS": args, "SKYPILOT_NODE_RANK": "2",
           "SKYPILOT_NUM_NODES": "4"}
    result = subprocess.run(["bash", "-c", task["run"]], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    banner, argv = result.stdout.splitlines()
    return banner, json.loads(argv)


def test_the_task_files_run_starts_the_launchers_train_command_on_each_host(tmp_path):
    task = _task_file(BUCKET)
    banner, argv = _run_on_a_host(tmp_path)
    assert banner.startswith("host 2 of 4: jaxreplay train")
    args = argparse.Namespace(name=task["envs"]["RUN"], bucket=BUCKET,
                              overrides=recipe_paths(BUCKET, "Qwen2.5-0.5B-Instruct"))
    expected = LAUNCHER.train_command(args, LAUNCHER.DEFAULT, task["envs"]["CONFIG"], "")
    assert argv == expected[1:]
    assert task["envs"]["MODEL"] == "models/Qwen2.5-0.5B-Instruct"
    assert task["envs"]["DATA"] == "data/gsm8k/main/{split}-*.parquet"


def test_the_task_file_runs_a_config_naming_reverb_on_reverb_through_host_0s_port(tmp_path):
    """ARGS (or CONFIG) naming replay.backend=reverb: the host trains on Reverb, which the setup gave a sidecar,
    at the launcher's port; the address is left to the coordinator's host (JAX finds it in the TPU metadata)."""
    _, argv = _run_on_a_host(tmp_path, "replay.backend=reverb train.steps=50")
    assert argv[-3:] == ["distributed.enabled=true", "replay.backend=reverb", f"replay.port={LAUNCHER.REPLAY_PORT}"]
    assert "train.steps=50" in argv and not any(a.startswith("distributed.replay_address") for a in argv)
    _, argv = _run_on_a_host(tmp_path, "replay.backend=auto")
    assert argv[-2:] == ["distributed.enabled=true", "replay.backend=inprocess"]


def test_the_task_files_slice_is_its_configs_slice():
    task = _task_file()
    (accelerator,) = [task["resources"]["accelerators"]]
    topology = _raw(task["envs"]["CONFIG"])["mesh"]["topology"]
    assert accelerator == "tpu-" + LAUNCHER.TPUS[topology].accelerator_type
    assert task["resources"]["accelerator_args"]["runtime_version"] == LAUNCHER.TPUS[topology].runtime_version


# What the SkyPilot venv runs: the task file through sky.Task.from_yaml, and the page's
# `sky jobs launch` lines through SkyPilot's own command-line parser.
SKY_CHECK = r"""
import json, sys
import sky, yaml
from sky.client.cli import command
from sky.utils import registry, schemas

task_file, launches = sys.argv[1], json.loads(sys.argv[2])
out = {"errors": {}}
try:
    sky.Task.from_yaml(task_file)
except ValueError as e:
    out["errors"]["shipped"] = str(e)
for name, path in json.loads(sys.argv[3]).items():
    try:
        sky.Task.from_yaml(path)
    except Exception as e:
        out["errors"][name] = f"{type(e).__name__}: {e}"
task = sky.Task.from_yaml(json.loads(sys.argv[3])["with_bucket"])
(resources,) = task.resources
out["task"] = {"num_nodes": task.num_nodes, "accelerators": resources.accelerators, "use_spot": resources.use_spot,
               "accelerator_args": resources.accelerator_args, "job_recovery": resources.job_recovery,
               "cloud": str(resources.cloud), "envs": task.envs}
out["strategies"] = sorted(registry.JOBS_RECOVERY_STRATEGY_REGISTRY.keys())
recovery = schemas.get_resources_schema()["properties"]["job_recovery"]["anyOf"][1]
out["recovery_keys"] = sorted(recovery["properties"])
out["launches"] = []
for words in launches:
    params = command.jobs_launch.make_context("launch", words).params
    out["launches"].append({"entrypoint": list(params["entrypoint"]), "name": params["name"],
                            "gpus": params["gpus"], "env": [list(kv) for kv in params["env"]]})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sky_check(tmp_path_factory) -> dict:
    if not SKY_PYTHON.exists():
        pytest.skip("SkyPilot lives in its own venv: make venv-skypilot (.venv-skypilot)")
    tmp = tmp_path_factory.mktemp("sky")
    variants = {"with_bucket": _task_file(BUCKET)}
    typo = _task_file(BUCKET)
    typo["resources"]["use_spots"] = typo["resources"].pop("use_spot")
    variants["typo"] = typo
    paths = {}
    for name, task in variants.items():
        paths[name] = str(tmp / f"{name}.yaml")
        Path(paths[name]).write_text(yaml.safe_dump(task, sort_keys=False))
    launches = [words[3:] for words in _doc_commands("sky") if words[1:3] == ["jobs", "launch"]]
    result = subprocess.run([str(SKY_PYTHON), "-c", SKY_CHECK, str(TASK_FILE), json.dumps(launches),
                             json.dumps(paths)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "SKYPILOT_DISABLE_USAGE_COLLECTION": "1", "HOME": str(tmp)})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@needs_skypilot
def test_skypilot_reads_the_task_file_as_a_spot_tpu_slice_it_recovers(sky_check):
    errors = sky_check["errors"]
    assert "'BUCKET' is None" in errors.pop("shipped")  # the bucket must be given: --env BUCKET=gs://...
    assert "use_spots" in errors.pop("typo") and errors == {}  # an unknown key is an error: the check is real
    task = sky_check["task"]
    assert task["num_nodes"] == 1 and task["use_spot"] is True and task["cloud"] == "GCP"
    assert task["accelerators"] == {"tpu-v5litepod-16": 1}
    assert task["accelerator_args"] == {"runtime_version": "v2-alpha-tpuv5-lite"}
    recovery = task["job_recovery"]
    # The client passes job_recovery through unchecked (the API server checks it): check it against 0.14.1's.
    assert recovery["strategy"].lower() in sky_check["strategies"]
    assert set(recovery) <= set(sky_check["recovery_keys"])
    assert 143 in recovery["recover_on_exit_codes"]  # jaxreplay's exit after a SIGTERM
    assert task["envs"]["BUCKET"] == BUCKET


@needs_skypilot
def test_the_recipes_sky_commands_launch_the_task_file_on_matching_slices(sky_check):
    launches = sky_check["launches"]
    assert len(launches) == 2
    envs = _task_file()["envs"]
    for launch in launches:
        assert launch["entrypoint"] == ["launch/skypilot.yaml"]
        env = {**envs, **dict(launch["env"])}
        assert set(env) == set(envs) and env["BUCKET"] == BUCKET
        accelerator = launch["gpus"] or _task_file()["resources"]["accelerators"]
        topology = _raw(env["CONFIG"])["mesh"]["topology"]
        assert accelerator == "tpu-" + LAUNCHER.TPUS[topology].accelerator_type, launch
        assert env["CONFIG"] in GSM8K_CONFIGS
    assert {dict(launch["env"]).get("RUN", envs["RUN"]) for launch in launches} == {"gsm8k-v5e-8", "gsm8k-v5e-16"}


# ----------------------------------------------------------------------------------
# The pod config, shrunk: trains on CPU with the recipe's layout under one root


GSM8K_ROWS = [(f"Tom has {a} apples and buys {b} more. How many apples does he have?", f"{a}+{b}={a + b}\n#### {a + b}")
              for a, b in [(2, 3), (4, 1), (5, 5), (3, 6), (1, 1), (7, 2), (8, 1), (6, 3)]]


def stage_tiny_recipe(root: Path) -> None:
    """The recipe's bucket layout in a folder: a tiny model directory and GSM8K's main/{split} shards."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tiny_hf import write_model

    write_model(root / "models" / "tiny")
    data = root / "data" / "gsm8k" / "main"
    data.mkdir(parents=True)
    for split, rows in (("train", GSM8K_ROWS), ("test", GSM8K_ROWS[:4])):
        pq.write_table(pa.table({"question": [q for q, _ in rows], "answer": [a for _, a in rows]}),
                       data / f"{split}-00000-of-00001.parquet")


def _train(*overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxreplay", "train", "configs/pod_tiny_cpu.yaml", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_tiny_pod_config_trains_and_resumes_from_the_recipes_bucket(bucket, tmp_path):
    """The recipe's layout in a bucket (a real GCS server): model.hf_path, task.path and run.dir under it."""
    from jaxreplay import storage

    stage_tiny_recipe(tmp_path / "staged")
    storage.upload(tmp_path / "staged", bucket)
    run = storage.join(bucket, "runs", "tiny")
    layout = [*recipe_paths(bucket, "tiny"), f"run.dir={run}"]
    first = _train(*layout)
    assert first.returncode == 0, first.stderr[-3000:]

    def steps() -> list[int]:
        return [json.loads(line)["step"] for line in storage.read_text(storage.join(run, "metrics.jsonl")).splitlines()]

    assert steps() == [0, 1, 2, 3, 4]  # step 0: the evaluation before training
    assert json.loads(storage.read_text(storage.join(run, "summary.json")))["steps"] == 4
    resumed = _train(*layout, "train.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 4" in resumed.stdout + resumed.stderr
    assert steps() == [0, 1, 2, 3, 4, 5, 6]
