"""benchmarks/device.sh runs on the JAX its Python already has, installs nothing, and writes
every figure (here its tiny CPU dry run; the full run needs an accelerator)."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "device.sh"


def _device_sh(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(["bash", str(SCRIPT), str(out), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def _status() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--ignored"], capture_output=True,
                          text=True, timeout=60, check=True).stdout


def test_dry_run_on_cpu_uses_this_jax_and_installs_nothing(tmp_path):
    before = _status()
    result = _device_sh(tmp_path, "--quick")
    assert result.returncode == 0, result.stderr
    assert _status() == before  # no venv, no build or install files in the checkout
    results = json.loads((tmp_path / "device.json").read_text())
    assert results["versions"]["jax"] == jax.__version__ and results["platform"] == "cpu"
    assert results["params"] > 0 and [r["batch"] for r in results["decode"]] == [2, 4]
    assert all(r["ours_tok_s"] > 0 and r["compile_s"] > 0 for r in results["decode"])
    assert results["train"]["tokens_s"] > 0 and results["seconds"] < 300
    if importlib.util.find_spec("torch"):  # the transformers reference ran on the same weights
        assert results["decode"][0]["generate_tok_s"] > 0 and results["generate_skipped"] is None
    else:
        assert "generate_tok_s" not in results["decode"][0] and "not installed" in results["generate_skipped"]


def test_a_full_run_without_an_accelerator_is_refused_in_one_line(tmp_path):
    result = _device_sh(tmp_path)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    if tuple(int(v) for v in jax.__version__.split(".")[:2]) < (0, 8):  # the Reverb lane's jax 0.4.34
        assert result.stderr.startswith(f"device: jax {jax.__version__} is older than 0.8")
    else:
        assert result.stderr == "device: JAX sees no accelerator (only cpu): --quick runs the tiny dry run on CPU\n"


def test_a_python_without_jax_is_refused_in_one_line(tmp_path):
    bare = tmp_path / "python"  # no site-packages: no jax
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    env = {**os.environ, "PYTHON": str(bare)}
    result = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "out")], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "No module named" in result.stderr and "installs nothing" in result.stderr
