#!/usr/bin/env python3
"""Run jaxreplay on a Cloud TPU VM slice: every worker runs the same `jaxreplay train` (SPMD).

    python launch/tpu_pod.py up      --name rl --tpu v5e-8 --zone us-west4-a --config configs/pod_v5e-8_qwen2.5_0.5b.yaml
    python launch/tpu_pod.py logs    --name rl --tpu v5e-8 --zone us-west4-a [--worker all] [--follow]
    python launch/tpu_pod.py stop    --name rl --tpu v5e-8 --zone us-west4-a
    python launch/tpu_pod.py delete  --name rl --tpu v5e-8 --zone us-west4-a

`up` = `create`, `install`, `train` (each also runs alone). The config's `replay.backend`
picks the dependency tier the workers get: `reverb` the Reverb lane (Python 3.11, the
`reverb` extra, constraints/reverb-py311.txt, its jax[tpu]); anything else the default
tier (Python 3.12, constraints/default.txt, the current jax[tpu]; `auto` is `inprocess`
there). TPU runtime images ship an older Python, so `install` gives every worker its
tier's Python through uv, ships the committed tree (`git archive HEAD`), installs it with
the tier's constraints and checks the result. `train` starts `jaxreplay train` on all
workers with `distributed.enabled=true` and the resolved backend (for Reverb, worker 0's
internal IP as the server address); JAX finds the coordinator in the TPU metadata.

Before anything is created or shipped, `--dry-run` included, the config must be committed
unchanged (the workers get HEAD) and valid as the workers will run it; otherwise one
line and exit code 2. That check needs jaxreplay's requirements (pyyaml, numpy): without
them this script re-runs itself under `--python` or the checkout's `.venv/bin/python`
(`make demo` makes it). `--dry-run` prints every command and runs none (no gcloud, no
TPU). Arguments after the options are config overrides, e.g. `train.steps=50`.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
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


class Slice(NamedTuple):
    accelerator_type: str
    runtime_version: str  # the documented TPU software version for JAX on this generation
    generation: str


TPUS = {
    "v5e-8": Slice("v5litepod-8", "v2-alpha-tpuv5-lite", "v5e"),  # 8 chips, one host
    "v5e-16": Slice("v5litepod-16", "v2-alpha-tpuv5-lite", "v5e"),  # 16 chips, 4 hosts
    "v6e-8": Slice("v6e-8", "v2-alpha-tpuv6e", "v6e"),  # 8 chips, one host
    "v4-8": Slice("v4-8", "tpu-ubuntu2204-base", "v4"),  # 4 chips, one host
    "v4-16": Slice("v4-16", "tpu-ubuntu2204-base", "v4"),  # 8 chips, 2 hosts
}


class Tier(NamedTuple):
    """A dependency lane as the workers get it (README, "Dependency tiers")."""

    name: str
    python: str  # the Python version uv provides
    constraints: str  # the lane's constraints file: its jax==X pins jax[tpu]
    extras: str
    find_links: Optional[str]  # where jax[tpu]'s libtpu comes from when it is not on PyPI
    backend: str  # what replay.backend is on this tier (auto resolves to it)
    generations: frozenset  # the TPU generations its jax and libtpu were released for


DEFAULT = Tier("default", "3.12", "constraints/default.txt", "", None, "inprocess",
               frozenset({"v4", "v5e", "v6e"}))
# jax 0.4.34 pins libtpu-nightly 0.1.dev20241002, which is not on PyPI; it predates TPU v6e's release.
REVERB = Tier("reverb", "3.11", "constraints/reverb-py311.txt", "reverb", LIBTPU_RELEASES, "reverb",
              frozenset({"v4", "v5e"}))


class LaunchError(Exception):
    """Bad input: one line, exit code 2, before anything is created or shipped."""


def tier_for(backend: str) -> Tier:
    return REVERB if backend == "reverb" else DEFAULT


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
        "import sys, jax, jaxreplay" + (", reverb" if tier.backend == "reverb" else ""),
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
        f"echo {tier.name} > {TIER_FILE}",
    ]


def worker_overrides(args: argparse.Namespace, tier: Tier, worker0: str) -> list[str]:
    """The overrides every worker's `jaxreplay train` gets; the launcher's own come last."""
    forced = ["distributed.enabled=true", f"replay.backend={tier.backend}"]
    if tier.backend == "reverb":
        forced += [f"replay.port={REPLAY_PORT}", f"distributed.replay_address={worker0}:{REPLAY_PORT}"]
    return [f"run.dir={RUNS_DIR}/{args.name}", "run.progress_bar=false", *args.overrides, *forced]


def _gcloud(args: argparse.Namespace, *words: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", *words, f"--zone={args.zone}"]
    return cmd + ([f"--project={args.project}"] if args.project else [])


def _ssh(args: argparse.Namespace, worker: str, remote: str) -> list[str]:
    return _gcloud(args, "ssh", args.name, f"--worker={worker}", f"--command={remote}")


def create(args: argparse.Namespace) -> list[list[str]]:
    tpu = TPUS[args.tpu]
    return [_gcloud(args, "create", args.name, f"--accelerator-type={tpu.accelerator_type}",
                    f"--version={tpu.runtime_version}") + (["--spot"] if args.spot else [])]


def install(args: argparse.Namespace, tier: Tier) -> list[list[str]]:
    archive = f"/tmp/jaxreplay-{args.name}.tar.gz"
    return [
        ["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--output={archive}", "HEAD"],
        _gcloud(args, "scp", archive, f"{args.name}:jaxreplay.tar.gz", "--worker=all"),  # into ~ on each worker
        _ssh(args, "all", " && ".join(worker_setup(tier))),
    ]


def worker0_ip(args: argparse.Namespace) -> list[str]:
    return _gcloud(args, "describe", args.name, "--format=value(networkEndpoints[0].ipAddress)")


def train(args: argparse.Namespace, tier: Tier, config: str, worker0: str) -> list[list[str]]:
    command = shlex.join([".venv/bin/jaxreplay", "train", config, *worker_overrides(args, tier, worker0)])
    wrong_tier = f"echo 'tpu_pod: this worker has no {tier.name} tier: run install with this config' >&2"
    remote = (f"cd {REMOTE_DIR} || exit 2; grep -qx {tier.name} {TIER_FILE} || {{ {wrong_tier}; exit 2; }}; "
              f"nohup {command} > {LOG} 2>&1 < /dev/null & echo $! > {PID}")
    return [_ssh(args, "all", remote)]


def logs(args: argparse.Namespace) -> list[list[str]]:
    tail = f"tail -n {args.lines}" + (" -F" if args.follow else "")
    return [_ssh(args, args.worker, f"{tail} {LOG}")]


def stop(args: argparse.Namespace) -> list[list[str]]:
    return [_ssh(args, "all", f"test -f {PID} && kill $(cat {PID}) 2>/dev/null; rm -f {PID}; true")]


def delete(args: argparse.Namespace) -> list[list[str]]:
    return [_gcloud(args, "delete", args.name, "--quiet")]


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tpu_pod.py", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["up", "create", "install", "train", "logs", "stop", "delete"])
    parser.add_argument("--name", required=True, help="TPU VM name")
    parser.add_argument("--tpu", required=True, choices=sorted(TPUS), help="slice type")
    parser.add_argument("--zone", required=True, help="e.g. us-west4-a (v5e), us-central2-b (v4)")
    parser.add_argument("--project", help="GCP project (default: gcloud's)")
    parser.add_argument("--config", help="committed YAML config in this repository (up, install, train)")
    parser.add_argument("--python", help="a Python with jaxreplay's requirements, to check the config "
                                         "(default: this one, else the checkout's .venv/bin/python)")
    parser.add_argument("--spot", action="store_true", help="create a Spot TPU")
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
        tier = config = None
        if args.action in ("up", "install", "train"):
            if not args.config:
                raise LaunchError(f"{args.action} needs --config")
            config = shipped_config(args.config)
            ensure_requirements(args, argv)
            tier = check_config(args, config)
        for step in {"up": ["create", "install", "train"]}.get(args.action, [args.action]):
            if step == "train":
                ip = ""  # only Reverb needs an address: the default tier's table is sharded over the workers
                if tier.backend == "reverb":
                    ip = _run(worker0_ip(args), args.dry_run, capture=True) or "<worker0-ip>"
                commands = train(args, tier, config, ip)
            elif step == "install":
                commands = install(args, tier)
            else:
                commands = {"create": create, "logs": logs, "stop": stop, "delete": delete}[step](args)
            for cmd in commands:
                _run(cmd, args.dry_run, timeout=None if step == "logs" and args.follow else COMMAND_TIMEOUT_S)
    except LaunchError as e:
        print(f"tpu_pod: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
