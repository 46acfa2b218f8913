#!/usr/bin/env python3
"""Run jaxreplay on a Cloud TPU VM slice: every worker runs the same `jaxreplay train` (SPMD).

    python launch/tpu_pod.py up      --name rl --tpu v5e-8 --zone us-west4-a --config configs/tpu_v5e-8_qwen2.5-0.5b.yaml
    python launch/tpu_pod.py logs    --name rl --tpu v5e-8 --zone us-west4-a [--worker all] [--follow]
    python launch/tpu_pod.py stop    --name rl --tpu v5e-8 --zone us-west4-a
    python launch/tpu_pod.py delete  --name rl --tpu v5e-8 --zone us-west4-a

`up` = `create`, `install`, `train` (each also runs alone). `install` ships the committed
tree (`git archive HEAD`) to every worker and installs it with the jax[tpu] release that
matches the jax version pinned in pyproject.toml. `train` finds worker 0's internal IP
(it hosts the Reverb server and JAX's coordinator) and starts `jaxreplay train` on all
workers with `distributed.enabled=true` and the Reverb address; JAX detects the rest
(process ids, coordinator) from the TPU metadata. `--dry-run` prints every command,
runs none, and needs neither gcloud nor a TPU. Extra arguments after the options are
config overrides, e.g. `train.steps=50`.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
REMOTE_DIR = "~/jaxreplay"  # the installed tree on every worker
LOG = "~/jaxreplay-train.log"
PID = "~/jaxreplay-train.pid"
REPLAY_PORT = 9890  # Reverb on worker 0; JAX's coordinator keeps its default 8476
LIBTPU_RELEASES = "https://storage.googleapis.com/jax-releases/libtpu_releases.html"


class Tpu(NamedTuple):
    accelerator_type: str
    runtime_version: str


TPUS = {
    "v5e-8": Tpu("v5litepod-8", "v2-alpha-tpuv5-lite"),  # 8 chips, one host
    "v5e-16": Tpu("v5litepod-16", "v2-alpha-tpuv5-lite"),  # 16 chips, 4 hosts
    "v4-8": Tpu("v4-8", "tpu-ubuntu2204-base"),  # 4 chips, one host
    "v4-16": Tpu("v4-16", "tpu-ubuntu2204-base"),  # 8 chips, 2 hosts
}


def pinned_jax_version() -> str:
    """The `jax==X` pin in pyproject.toml: the TPU install must match what was tested here."""
    match = re.search(r'"jax==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    if not match:
        raise SystemExit("tpu_pod: no jax==X pin in pyproject.toml")
    return match.group(1)


def _gcloud(args: argparse.Namespace, *words: str) -> list[str]:
    cmd = ["gcloud", "compute", "tpus", "tpu-vm", *words, f"--zone={args.zone}"]
    return cmd + ([f"--project={args.project}"] if args.project else [])


def _ssh(args: argparse.Namespace, worker: str, remote: str) -> list[str]:
    return _gcloud(args, "ssh", args.name, f"--worker={worker}", f"--command={remote}")


def create(args: argparse.Namespace) -> list[list[str]]:
    tpu = TPUS[args.tpu]
    return [_gcloud(args, "create", args.name, f"--accelerator-type={tpu.accelerator_type}",
                    f"--version={tpu.runtime_version}") + (["--spot"] if args.spot else [])]


def install(args: argparse.Namespace) -> list[list[str]]:
    archive = f"/tmp/jaxreplay-{args.name}.tar.gz"
    jax_version = pinned_jax_version()
    remote = " && ".join([
        "set -e",
        "sudo apt-get update -qq && sudo apt-get install -y -qq python3-venv",  # ensurepip is not in the base image
        f"rm -rf {REMOTE_DIR} && mkdir -p {REMOTE_DIR}",
        f"tar -xzf ~/jaxreplay.tar.gz -C {REMOTE_DIR}",
        f"cd {REMOTE_DIR}",
        "python3 -m venv .venv",
        ".venv/bin/pip install --quiet --upgrade pip",
        f".venv/bin/pip install --quiet -e . 'jax[tpu]=={jax_version}' -f {LIBTPU_RELEASES}",
        ".venv/bin/python -c 'import jax; print(jax.process_index(), jax.device_count(), jax.devices()[0].platform)'",
    ])
    return [
        ["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--output={archive}", "HEAD"],
        _gcloud(args, "scp", archive, f"{args.name}:jaxreplay.tar.gz", "--worker=all"),  # into ~ on each worker
        _ssh(args, "all", remote),
    ]


def worker0_ip(args: argparse.Namespace) -> list[str]:
    return _gcloud(args, "describe", args.name, "--format=value(networkEndpoints[0].ipAddress)")


def train(args: argparse.Namespace, worker0: str) -> list[list[str]]:
    config = Path(args.config).resolve().relative_to(ROOT).as_posix()  # the same path inside the shipped tree
    overrides = [
        "distributed.enabled=true", f"replay.port={REPLAY_PORT}",
        f"distributed.replay_address={worker0}:{REPLAY_PORT}", f"run.dir=runs/{args.name}",
        "run.progress_bar=false", *args.overrides,
    ]
    command = shlex.join([".venv/bin/jaxreplay", "train", config, *overrides])
    remote = f"cd {REMOTE_DIR} && nohup {command} > {LOG} 2>&1 < /dev/null & echo $! > {PID}"
    return [_ssh(args, "all", remote)]


def logs(args: argparse.Namespace) -> list[list[str]]:
    tail = f"tail -n {args.lines}" + (" -F" if args.follow else "")
    return [_ssh(args, args.worker, f"{tail} {LOG}")]


def stop(args: argparse.Namespace) -> list[list[str]]:
    return [_ssh(args, "all", f"test -f {PID} && kill $(cat {PID}) 2>/dev/null; rm -f {PID}; true")]


def delete(args: argparse.Namespace) -> list[list[str]]:
    return [_gcloud(args, "delete", args.name, "--quiet")]


def check_config(args: argparse.Namespace) -> None:
    """The config must load here, with the launcher's overrides, before any TPU time is spent."""
    sys.path.insert(0, str(ROOT))
    from jaxreplay.config import ConfigError, load_config

    try:
        load_config(args.config, ["distributed.enabled=true", f"replay.port={REPLAY_PORT}", *args.overrides])
    except ConfigError as e:
        raise SystemExit(f"tpu_pod: config error: {e}") from None


def _run(cmd: list[str], dry_run: bool, capture: bool = False) -> str:
    print("+ " + shlex.join(cmd), flush=True)
    if dry_run:
        return ""
    result = subprocess.run(cmd, check=False, text=True, capture_output=capture)
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
    parser.add_argument("--config", help="YAML config under this repository (train, up)")
    parser.add_argument("--spot", action="store_true", help="create a Spot TPU")
    parser.add_argument("--worker", default="0", help="logs: a worker index, or all")
    parser.add_argument("--lines", type=int, default=100, help="logs: lines to show")
    parser.add_argument("--follow", action="store_true", help="logs: keep following")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("overrides", nargs="*", help="config overrides for train, e.g. train.steps=50")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_intermixed_args(argv)
    if args.action in ("up", "train"):
        if not args.config:
            raise SystemExit(f"tpu_pod: {args.action} needs --config")
        check_config(args)
    steps = {"up": ["create", "install", "train"]}.get(args.action, [args.action])
    for step in steps:
        if step == "train":
            ip = _run(worker0_ip(args), args.dry_run, capture=True) or "<worker0-ip>"
            commands = train(args, ip)
        else:
            commands = {"create": create, "install": install, "logs": logs, "stop": stop, "delete": delete}[step](args)
        for cmd in commands:
            _run(cmd, args.dry_run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
