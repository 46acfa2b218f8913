#!/usr/bin/env python3
"""Run jaxreplay on a Cloud TPU VM slice: every worker runs the same `jaxreplay train` (SPMD).

    python launch/tpu_pod.py up      --name rl --tpu v5e-8 --zone us-west4-a --config configs/pod_v5e-8_qwen2.5_0.5b.yaml \
                                     --bucket gs://BUCKET --spot
    python launch/tpu_pod.py resume  --name rl --bucket gs://BUCKET
    python launch/tpu_pod.py logs    --name rl --tpu v5e-8 --zone us-west4-a [--worker all] [--follow]
    python launch/tpu_pod.py stop    --name rl --tpu v5e-8 --zone us-west4-a
    python launch/tpu_pod.py delete  --name rl --tpu v5e-8 --zone us-west4-a

`up` = `create`, `install`, `train` (each also runs alone). `create` asks for the slice as a
queued resource (`--spot`: Spot capacity) and waits until it is ACTIVE; `delete` deletes the
queued resource and its slice. Every worker gets the default tier (Python 3.12,
constraints/default.txt, the current jax[tpu]); a config naming `replay.backend: reverb`
adds Reverb's sidecar environment beside it (`.venv-sidecar`: Python 3.11, dm-reverb
0.14.0, TensorFlow 2.15 CPU, PyYAML, as `make venv-sidecar` builds it), on single-host and
multi-host slices alike: worker 0's sidecar serves the table, every other worker's holds a
Reverb client to it (jaxreplay/replay/sidecar.py). `auto` is `inprocess` there. TPU
runtime images ship an older Python (3.10), so `install` gives every worker its Pythons
through uv, ships the committed tree (`git archive HEAD`), installs it with the tier's
constraints and checks the result. `train` starts `jaxreplay train` on all workers with
`distributed.enabled=true` and the resolved backend (for Reverb, worker 0's internal IP as
the server address); JAX finds the coordinator in the TPU metadata. (The Reverb lane,
Python 3.11 with jax 0.4.34, is what `reverb` installed before; `resume` still reinstalls it
for a launch recorded with it.)

With `--bucket gs://BUCKET`, the run dir is `gs://BUCKET/runs/NAME` (else each worker's own
`~/jaxreplay-runs/NAME`, lost with the VM), every worker's log is copied to its `logs/` every
minute and when training ends, and `up` stores what it launched (tier, commit, config, overrides,
slice) in its `launch.json`. After a preemption has deleted the slice, `resume` reads that file,
recreates the slice under the same name, installs the same commit and reruns the same train
command, which resumes from the run dir's latest checkpoint. It runs once: it is no daemon
(SkyPilot's managed jobs are one: launch/skypilot.yaml).

Before anything is created or shipped, `--dry-run` included, the config must be committed
unchanged (the workers get HEAD), name the slice `--tpu` names (`mesh.topology`, where set)
and be valid as the workers will run it; otherwise one line and exit code 2. That check needs
jaxreplay's requirements (pyyaml, numpy): without
them this script re-runs itself under `--python` or the checkout's `.venv/bin/python`
(`make demo` makes it). `--dry-run` prints every command and runs none (no gcloud, no
TPU). Arguments after the options are config overrides, e.g. `train.steps=50`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parents[1]
REMOTE_DIR = "~/jaxreplay"  # the installed tree on every worker; replaced by each install
RUNS_DIR = "../jaxreplay-runs"  # run directories, relative to REMOTE_DIR: outside it, so an install keeps them
LOG = "~/jaxreplay-train.log"
PID = "~/jaxreplay-train.pid"
TIER_FILE = ".venv/jaxreplay-tier"  # which tier install put on the worker; train checks it
REPLAY_PORT = 9890  # Reverb on worker 0; JAX's coordinator keeps its default 8476
UV = "uv==0.13.9"  # provides the tier's Python on the workers
UV_VENV = "~/.jaxreplay-uv"  # uv's own venv, on the image's Python
LIBTPU_RELEASES = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"
REEXEC = "TPU_POD_REEXEC"  # set when this script re-runs itself under another Python
COMMAND_TIMEOUT_S = 3600  # any one gcloud or git command
POLL_S = 30  # between looks at a queued resource that is not ACTIVE yet
LAUNCH_FILE = "launch.json"  # in the bucket run dir: what `up` launched, for `resume`
WORKER = "launch/pod_worker.sh"  # runs train on a worker and copies its log to the bucket


class Slice(NamedTuple):
    accelerator_type: str
    runtime_version: str  # the documented TPU software version for JAX on this generation
    generation: str
    hosts: int  # TPU VM workers, one jaxreplay process each


TPUS = {
    "v5e-8": Slice("v5litepod-8", "v2-alpha-tpuv5-lite", "v5e", 1),  # 8 chips, one host
    "v5e-16": Slice("v5litepod-16", "v2-alpha-tpuv5-lite", "v5e", 4),  # 16 chips, 4 hosts
    "v6e-8": Slice("v6e-8", "v2-alpha-tpuv6e", "v6e", 1),  # 8 chips, one host
    "v4-8": Slice("v4-8", "tpu-ubuntu2204-base", "v4", 1),  # 4 chips, one host
    "v4-16": Slice("v4-16", "tpu-ubuntu2204-base", "v4", 2),  # 8 chips, 2 hosts
}


class Tier(NamedTuple):
    """A dependency lane as the workers get it (docs/install.md)."""

    name: str
    python: str  # the Python version uv provides
    constraints: str  # the lane's constraints file: its jax==X pins jax[tpu]
    extras: str
    find_links: Optional[str]  # where jax[tpu]'s libtpu comes from when it is not on PyPI
    backend: str  # what replay.backend is on this tier (auto resolves to it)
    generations: frozenset  # the TPU generations its jax and libtpu were released for
    sidecar: bool = False  # Reverb's sidecar environment beside it (.venv-sidecar)


DEFAULT = Tier("default", "3.12", "constraints/default.txt", "", None, "inprocess",
               frozenset({"v4", "v5e", "v6e"}))
# jax 0.4.34 pins libtpu-nightly 0.1.dev20241002, which is not on PyPI; it predates TPU v6e's release.
# The default tier with Reverb's sidecar environment: replay.backend=reverb on the current jax.
SIDECAR = Tier("sidecar", "3.12", "constraints/default.txt", "", None, "reverb", frozenset({"v4", "v5e", "v6e"}),
               sidecar=True)
# The Reverb lane: what `reverb` configs installed before the sidecar; kept for `resume` of launches recorded with it.
REVERB = Tier("reverb", "3.11", "constraints/reverb-py311.txt", "reverb", LIBTPU_RELEASES, "reverb",
              frozenset({"v4", "v5e"}))
TIERS = {t.name: t for t in (DEFAULT, SIDECAR, REVERB)}
# `make venv-sidecar` (Makefile): its Python, the pins it installs with and what it installs
SIDECAR_PYTHON = "3.11"
SIDECAR_PINS = "constraints/reverb-py311.txt"
SIDECAR_PACKAGES = ("dm-reverb", "tensorflow-cpu", "pyyaml")


class LaunchError(Exception):
    """Bad input: one line, exit code 2, before anything is created or shipped."""


def tier_for(backend: str) -> Tier:
    return SIDECAR if backend == "reverb" else DEFAULT


def pinned_jax_version(tier: Tier) -> str:
    """The `jax==X` of the tier's constraints file: the workers get the jax that was tested."""
    match = re.search(r"^jax==(\S+)$", (ROOT / tier.constraints).read_text(), re.MULTILINE)
    if not match:
        raise LaunchError(f"no jax==X line in {tier.constraints}")
    return match.group(1)


def worker_setup(tier: Tier) -> list[str]:
    """The shell commands that install `tier` on a worker, in order (joined with && over ssh)."""
    jax_version = pinned_jax_version(tier)
    package = f".[{tier.extras}]" if tier.extras else "."
    pip = [".venv/bin/python", "-m", "pip", "install", "--quiet", "-c", tier.constraints, "-e", package,
           f"jax[tpu]=={jax_version}", *(["-f", tier.find_links] if tier.find_links else [])]
    major, minor = tier.python.split(".")
    check = "; ".join([
        "import sys, jax, jaxreplay" + (", reverb" if "reverb" in tier.extras else ""),  # the Reverb lane
        f"assert sys.version_info[:2] == ({major}, {minor}), sys.version",
        f'assert jax.__version__ == "{jax_version}", jax.__version__',
        'assert jax.local_devices()[0].platform == "tpu", jax.local_devices()',
        'print("python", sys.version.split()[0], "jax", jax.__version__, jax.local_device_count(), "tpu chips")',
    ])
    return [
        "sudo apt-get update -qq",
        "sudo apt-get install -y -qq python3-venv",  # ensurepip is not in the image's Python
        f"python3 -m venv {UV_VENV}",
        f"{UV_VENV}/bin/pip install --quiet {UV}",
        f"rm -rf {REMOTE_DIR}",
        f"mkdir -p {REMOTE_DIR}",
        f"tar -xzf ~/jaxreplay.tar.gz -C {REMOTE_DIR}",
        f"cd {REMOTE_DIR}",
        f"{UV_VENV}/bin/uv venv --seed --python {tier.python} .venv",  # uv fetches that CPython if missing
        shlex.join(pip),
        shlex.join([".venv/bin/python", "-c", check]),
        *(sidecar_setup() if tier.sidecar else []),
        f"echo {tier.name} > {TIER_FILE}",
    ]


def sidecar_setup() -> list[str]:
    """`make venv-sidecar` on a worker, in the tree's directory: Python 3.11 from uv (the image's
    is 3.10), dm-reverb and TensorFlow under the Reverb lane's pins; then the trainer's own check
    that it finds that Python and its dm-reverb, as `replay.backend=reverb` will."""
    find = 'from jaxreplay.replay.sidecar import find_python; print("reverb sidecar:", *find_python())'
    return [
        f"{UV_VENV}/bin/uv venv --seed --python {SIDECAR_PYTHON} .venv-sidecar",
        shlex.join([".venv-sidecar/bin/python", "-m", "pip", "install", "--quiet", "-c", SIDECAR_PINS,
                    *SIDECAR_PACKAGES]),
        shlex.join([".venv/bin/python", "-c", find]),
    ]


def worker_overrides(args: argparse.Namespace, tier: Tier, worker0: str) -> list[str]:
    """The overrides every worker's `jaxreplay train` gets; the launcher's own come last."""
    forced = ["distributed.enabled=true", f"replay.backend={tier.backend}"]
    if tier.backend == "reverb":
        forced += [f"replay.port={REPLAY_PORT}", f"distributed.replay_address={worker0}:{REPLAY_PORT}"]
    return [f"run.dir={run_dir(args)}", "run.progress_bar=false", *args.overrides, *forced]


def run_dir(args: argparse.Namespace) -> str:
    """The run dir every worker trains in: on the bucket with `--bucket`, else on its own disk."""
    return f"{args.bucket.rstrip('/')}/runs/{args.name}" if args.bucket else f"{RUNS_DIR}/{args.name}"


def _gcloud(args: argparse.Namespace, *words: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", *words, f"--zone={args.zone}"]
    return cmd + ([f"--project={args.project}"] if args.project else [])


def _ssh(args: argparse.Namespace, worker: str, remote: str) -> list[str]:
    return _gcloud(args, "ssh", args.name, f"--worker={worker}", f"--command={remote}")


def _queued(args: argparse.Namespace, *words: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "queued-resources", *words, f"--zone={args.zone}"]
    return cmd + ([f"--project={args.project}"] if args.project else [])


def create(args: argparse.Namespace) -> list[list[str]]:
    """A queued resource for the slice (Spot capacity with `--spot`); `wait_active` waits for it."""
    tpu = TPUS[args.tpu]
    return [_queued(args, "create", args.name, f"--node-id={args.name}", f"--accelerator-type={tpu.accelerator_type}",
                    f"--runtime-version={tpu.runtime_version}") + (["--spot"] if args.spot else [])]


def queued_state(args: argparse.Namespace) -> list[str]:
    return _queued(args, "describe", args.name, "--format=value(state.state)")


def install(args: argparse.Namespace, tier: Tier, commit: str = "HEAD") -> list[list[str]]:
    archive = os.path.join(tempfile.gettempdir(), f"jaxreplay-{args.name}.tar.gz")
    return [
        ["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--output={archive}", commit],
        _gcloud(args, "scp", archive, f"{args.name}:jaxreplay.tar.gz", "--worker=all"),  # into ~ on each worker
        _ssh(args, "all", " && ".join(worker_setup(tier))),
    ]


def worker0_ip(args: argparse.Namespace) -> list[str]:
    return _gcloud(args, "describe", args.name, "--format=value(networkEndpoints[0].ipAddress)")


def train_command(args: argparse.Namespace, tier: Tier, config: str, worker0: str) -> list[str]:
    return [".venv/bin/jaxreplay", "train", config, *worker_overrides(args, tier, worker0)]


def train(args: argparse.Namespace, tier: Tier, command: list[str]) -> list[list[str]]:
    """Every worker starts the same command under launch/pod_worker.sh, which copies its log to the bucket."""
    command = shlex.join(command)
    logs_url = shlex.quote(f"{run_dir(args)}/logs" if args.bucket else "")
    wrong_tier = f"echo 'tpu_pod: this worker has no {tier.name} tier: run install with this config' >&2"
    remote = (f"cd {REMOTE_DIR} || exit 2; grep -qx {tier.name} {TIER_FILE} || {{ {wrong_tier}; exit 2; }}; "
              f"nohup bash {WORKER} {LOG} {logs_url} {command} > /dev/null 2>&1 < /dev/null & echo $! > {PID}")
    return [_ssh(args, "all", remote)]


def logs(args: argparse.Namespace) -> list[list[str]]:
    tail = f"tail -n {args.lines}" + (" -F" if args.follow else "")
    return [_ssh(args, args.worker, f"{tail} {LOG}")]


def stop(args: argparse.Namespace) -> list[list[str]]:
    return [_ssh(args, "all", f"test -f {PID} && kill $(cat {PID}) 2>/dev/null; rm -f {PID}; true")]


def delete(args: argparse.Namespace) -> list[list[str]]:
    """The queued resource and, `--force`, the slice it holds."""
    return [_queued(args, "delete", args.name, "--force", "--quiet")]


def launch_url(args: argparse.Namespace) -> str:
    return f"{run_dir(args)}/{LAUNCH_FILE}"


def launch_record(args: argparse.Namespace, tier: Tier, config: str, commit: str) -> dict:
    """What `resume` needs to rerun this launch: the slice, the tier, the commit and the train command."""
    return {"name": args.name, "tpu": args.tpu, "zone": args.zone, "project": args.project, "spot": args.spot,
            "bucket": args.bucket, "tier": tier.name, "commit": commit, "config": config,
            "overrides": list(args.overrides), "command": train_command(args, tier, config, "<worker0-ip>")}


# ----------------------------------------------------------------------------------
# Checks before anything is created or shipped


def _git(*words: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *words], capture_output=True, text=True,
                              timeout=COMMAND_TIMEOUT_S, check=False)
    except FileNotFoundError:
        raise LaunchError("git not found: the workers get the repository's committed tree (git archive)") from None


def shipped_config(path_arg: str) -> str:
    """`--config`'s path inside the shipped tree; refuses a config the workers would not get as it is here."""
    path = Path(path_arg).resolve()
    if not path.is_file():
        raise LaunchError(f"--config {path_arg}: no such file")
    try:
        relative = path.relative_to(ROOT).as_posix()
    except ValueError:
        raise LaunchError(f"--config {path_arg} is outside the repository {ROOT}: the workers get only its "
                          "committed tree; add the config there (e.g. configs/) and commit it") from None
    if _git("ls-files", "--error-unmatch", "--", relative).returncode:
        raise LaunchError(f"--config {relative} is not committed: the workers get `git archive HEAD`, "
                          "which lacks it; commit it first")
    if _git("diff", "--quiet", "HEAD", "--", relative).returncode:
        raise LaunchError(f"--config {relative} has uncommitted changes: the workers would run the "
                          "committed version; commit them first")
    return relative


def _has_requirements() -> bool:
    sys.path.insert(0, str(ROOT))
    try:
        import jaxreplay.config  # noqa: F401  (pyyaml, numpy)
    except ImportError:
        return False
    return True


def ensure_requirements(args: argparse.Namespace, argv: list[str]) -> None:
    """Re-runs this script under `--python`, or under the checkout's .venv when this Python lacks
    jaxreplay's requirements; the re-run checks it has them."""
    if os.environ.get(REEXEC):
        if not _has_requirements():
            raise LaunchError(f"{args.python or sys.executable} lacks jaxreplay's requirements (pyyaml, numpy)")
        return
    if args.python:
        python = shutil.which(args.python) or args.python
        if not os.access(python, os.X_OK):
            raise LaunchError(f"--python {args.python}: no such executable")
    elif _has_requirements():
        return
    else:
        python = str(ROOT / ".venv" / "bin" / "python")
        if not os.access(python, os.X_OK):
            raise LaunchError(f"checking the config needs jaxreplay's requirements (pyyaml, numpy), which "
                              f"{sys.executable} lacks, and there is no {python}: run `make demo` once (it makes "
                              ".venv) or pass --python")
    sys.stdout.flush()
    os.execve(python, [python, str(Path(__file__).resolve()), *argv], {**os.environ, REEXEC: "1"})


def check_config(args: argparse.Namespace, config: str) -> Tier:
    """The workers' tier, once `config` (a path in the shipped tree) is valid as the workers will
    run it: with the launcher's overrides and `auto` resolved for their tier."""
    from jaxreplay.config import ConfigError, load_config

    try:
        backend = load_config(ROOT / config, [*args.overrides, "distributed.enabled=true"], local=False).replay.backend
    except ConfigError as e:
        raise LaunchError(f"config error: {e}") from None
    topology = load_config(ROOT / config, args.overrides, local=False).mesh.topology
    if topology is not None and topology != args.tpu:
        raise LaunchError(f"--tpu {args.tpu} is not the slice {config} is sized for (mesh.topology: {topology}): "
                          f"pass --tpu {topology}, or a config for {args.tpu}")
    tier, generation = tier_for(backend), TPUS[args.tpu].generation
    if generation not in tier.generations:
        raise LaunchError(f"replay.backend={backend} needs the {tier.name} tier (jax {pinned_jax_version(tier)}), "
                          f"which was released before TPU {generation}: use another backend or slice")
    try:
        load_config(ROOT / config, worker_overrides(args, tier, "<worker0-ip>"), local=False)
    except ConfigError as e:
        raise LaunchError(f"config error on the workers ({tier.name} tier, replay.backend={tier.backend}): {e}") \
            from None
    return tier


# ----------------------------------------------------------------------------------
# Running


def _run(cmd: list[str], dry_run: bool, capture: bool = False, timeout: Optional[float] = COMMAND_TIMEOUT_S) -> str:
    print("+ " + shlex.join(cmd), flush=True)
    if dry_run:
        return ""
    try:
        result = subprocess.run(cmd, check=False, text=True, capture_output=capture, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"tpu_pod: no answer in {timeout:.0f}s from: {shlex.join(cmd)}") from None
    if result.returncode:
        raise SystemExit(f"tpu_pod: command failed with exit code {result.returncode}: {shlex.join(cmd)}"
                         + (f"\n{result.stderr.strip()}" if capture and result.stderr else ""))
    return result.stdout.strip() if capture else ""


def _probe(cmd: list[str]) -> subprocess.CompletedProcess:
    """`cmd` run for its answer, whatever its exit code."""
    print("+ " + shlex.join(cmd), flush=True)
    try:
        return subprocess.run(cmd, check=False, text=True, capture_output=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"tpu_pod: no answer in {COMMAND_TIMEOUT_S}s from: {shlex.join(cmd)}") from None


def _gone(probe: subprocess.CompletedProcess) -> bool:
    """A describe that failed because the resource does not exist (any other failure is an error)."""
    if probe.returncode == 0:
        return False
    if "NOT_FOUND" in probe.stderr or "not found" in probe.stderr:
        return True
    raise SystemExit(f"tpu_pod: command failed with exit code {probe.returncode}: {shlex.join(probe.args)}\n"
                     f"{probe.stderr.strip()}")


def wait_active(args: argparse.Namespace) -> None:
    """Polls the queued resource until its slice is ACTIVE; a state it cannot leave, or `--wait-s`, ends the launch."""
    deadline = time.monotonic() + args.wait_s
    while True:
        state = _run(queued_state(args), args.dry_run, capture=True)
        if args.dry_run or state == "ACTIVE":
            return
        if state in ("FAILED", "SUSPENDED", "SUSPENDING"):
            raise SystemExit(f"tpu_pod: queued resource {args.name} is {state}: `delete`, then `up` or `resume`")
        if time.monotonic() > deadline:
            raise SystemExit(f"tpu_pod: queued resource {args.name} is still {state or 'unknown'} after "
                             f"{args.wait_s:.0f}s (--wait-s); it stays queued: `delete` it to give up")
        time.sleep(POLL_S)


def store_launch(args: argparse.Namespace, record: dict) -> None:
    """launch.json in the run dir, before anything is created: `resume` reruns it."""
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / LAUNCH_FILE
        local.write_text(json.dumps(record, indent=1) + "\n")
        _run(["gcloud", "storage", "cp", str(local), launch_url(args)], args.dry_run)


def read_launch(args: argparse.Namespace) -> dict:
    url = launch_url(args)
    got = _probe(["gcloud", "storage", "cat", url])
    if got.returncode:
        why = (got.stderr.strip().splitlines() or ["no answer"])[-1]
        raise LaunchError(f"cannot read {url} ({why}): resume reruns what `up --bucket` stored there")
    try:
        record = json.loads(got.stdout)
        missing = {"tpu", "zone", "project", "spot", "tier", "commit", "command"} - set(record)
    except (json.JSONDecodeError, TypeError):
        raise LaunchError(f"{url} is not a launch record (JSON) written by `up`") from None
    if missing:
        raise LaunchError(f"{url} lacks {', '.join(sorted(missing))}: not a launch record written by `up`")
    return record


def resume(args: argparse.Namespace) -> None:
    """Recreates a deleted slice of the same name, installs the stored commit and reruns the stored command."""
    if not args.bucket:
        raise LaunchError("resume needs --bucket: the bucket `up --bucket` stored the launch in")
    if args.dry_run or args.overrides or args.config:
        raise LaunchError("resume reruns the launch stored in the bucket: it takes no --config, overrides or "
                          "--dry-run")
    record = read_launch(args)
    for key in ("tpu", "zone", "project"):
        given = getattr(args, key)
        if given is not None and given != record[key]:
            raise LaunchError(f"--{key} {given} is not the stored launch's ({record[key]}): omit it")
        setattr(args, key, record[key])
    args.spot = record["spot"]
    if _git("cat-file", "-e", f"{record['commit']}^{{commit}}").returncode:
        raise LaunchError(f"commit {record['commit']} of the stored launch is not in this repository: fetch it")
    tier = TIERS[record["tier"]]
    probe = _probe(queued_state(args))
    if not _gone(probe):
        if probe.stdout.strip() == "ACTIVE":
            raise LaunchError(f"slice {args.name} is ACTIVE: nothing to recreate (`stop` and `train` restart "
                              "training on it)")
        _run(delete(args)[0], False)  # SUSPENDED after a preemption: its name is taken until it is deleted
    _run(create(args)[0], False)
    wait_active(args)
    for cmd in install(args, tier, record["commit"]):
        _run(cmd, False)
    ip = _run(worker0_ip(args), False, capture=True) if tier.backend == "reverb" else ""
    for cmd in train(args, tier, [word.replace("<worker0-ip>", ip) for word in record["command"]]):
        _run(cmd, False)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpu_pod.py", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["up", "create", "install", "train", "logs", "stop", "delete", "resume"])
    parser.add_argument("--name", required=True, help="TPU VM name")
    parser.add_argument("--tpu", choices=sorted(TPUS), help="slice type (resume: the stored one)")
    parser.add_argument("--zone", help="e.g. us-west4-a (v5e), us-central2-b (v4) (resume: the stored one)")
    parser.add_argument("--bucket", help="gs://BUCKET[/PREFIX]: the run dir is BUCKET/runs/NAME, with the workers' "
                                         "logs and the launch record (up, train, resume)")
    parser.add_argument("--project", help="GCP project (default: gcloud's)")
    parser.add_argument("--config", help="committed YAML config in this repository (up, install, train)")
    parser.add_argument("--python", help="a Python with jaxreplay's requirements, to check the config "
                                         "(default: this one, else the checkout's .venv/bin/python)")
    parser.add_argument("--spot", action="store_true", help="ask for Spot capacity")
    parser.add_argument("--wait-s", type=float, default=COMMAND_TIMEOUT_S,
                        help="create: how long to wait for the queued resource to become ACTIVE")
    parser.add_argument("--worker", default="0", help="logs: a worker index, or all")
    parser.add_argument("--lines", type=int, default=100, help="logs: lines to show")
    parser.add_argument("--follow", action="store_true", help="logs: keep following")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("overrides", nargs="*", help="config overrides for train, e.g. train.steps=50")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_intermixed_args(argv)
    try:
        if args.bucket is not None and not re.fullmatch(r"gs://[a-z0-9][-a-z0-9_.]*[a-z0-9](/\S*)?", args.bucket):
            raise LaunchError(f"--bucket {args.bucket}: not a gs://BUCKET[/PREFIX] URL")
        if args.action == "resume":
            resume(args)
            return 0
        for key in ("tpu", "zone"):
            if getattr(args, key) is None:
                raise LaunchError(f"{args.action} needs --{key}")
        tier = config = None
        if args.action in ("up", "install", "train"):
            if not args.config:
                raise LaunchError(f"{args.action} needs --config")
            config = shipped_config(args.config)
            ensure_requirements(args, argv)
            tier = check_config(args, config)
        if args.action == "up" and args.bucket:
            commit = _git("rev-parse", "HEAD").stdout.strip()
            store_launch(args, launch_record(args, tier, config, commit))
        for step in {"up": ["create", "install", "train"]}.get(args.action, [args.action]):
            if step == "train":
                ip = ""  # only Reverb needs an address: the default tier's table is sharded over the workers
                if tier.backend == "reverb":
                    ip = _run(worker0_ip(args), args.dry_run, capture=True) or "<worker0-ip>"
                commands = train(args, tier, train_command(args, tier, config, ip))
            elif step == "install":
                commands = install(args, tier)
            else:
                commands = {"create": create, "logs": logs, "stop": stop, "delete": delete}[step](args)
            for cmd in commands:
                _run(cmd, args.dry_run, timeout=None if step == "logs" and args.follow else COMMAND_TIMEOUT_S)
            if step == "create":
                wait_active(args)
    except LaunchError as e:
        print(f"tpu_pod: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
