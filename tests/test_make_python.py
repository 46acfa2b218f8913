"""`make` finds each lane's Python where it is installed but not on PATH (pyenv's versions, uv's
managed Pythons), and where there is none says how to get one and exits 2, creating nothing.

Each case runs the real make and the real interpreters under an environment that hides the
others: `make -n venv` shows the command that would create the venv, naming the interpreter."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SYSTEM_PATH = "/usr/bin:/bin"
LANE_OF = {(3, 11): "reverb", (3, 12): "gpu-image", (3, 13): "py313"}  # the lanes that take one version
# What an outer `make test` hands to this make (its command-line variables too) or a user set.
UNSET = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "PYTHON", "PYENV_VERSION", "VIRTUAL_ENV",
         "UV_PYTHON_INSTALL_DIR", "UV_PYTHON")


def make(*args, **env):
    clean = {k: v for k, v in os.environ.items() if k not in UNSET}
    return subprocess.run(["make", *args], cwd=ROOT, env={**clean, **env}, capture_output=True, text=True,
                          timeout=120)


def venv_command(result, venv):
    """The interpreter `make -n venv` would create `venv` with."""
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if f"-m venv {venv}" in line]
    assert len(lines) == 1, result.stdout
    return lines[0].split("|| ")[1].split(" -m venv")[0]


def runs_on(path, version):
    """Whether `pythonX.Y` or `python3` of that version runs from `path` (then nothing is hidden)."""
    for name in (f"python{version}", "python3"):
        probe = subprocess.run([name, "-c", "import sys; print(sys.version_info[:2])"], env={"PATH": path},
                               capture_output=True, text=True, timeout=60) if shutil.which(name, path=path) else None
        if probe and probe.stdout.strip() == str(tuple(int(x) for x in version.split("."))):
            return True
    return False


PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))


@pytest.mark.parametrize("lane, version", [("default", "3.12"), ("py313", "3.13"), ("reverb", "3.11")])
def test_make_finds_the_pyenv_version_that_pyenv_has_not_selected(tmp_path, lane, version):
    installed = sorted(PYENV_ROOT.glob(f"versions/{version}.*/bin/python{version}"))
    if not installed:
        pytest.skip(f"no pyenv Python {version} here")
    path = f"{PYENV_ROOT / 'shims'}:{SYSTEM_PATH}"
    if runs_on(path, version):
        pytest.skip(f"Python {version} runs from PATH here (pyenv's global selection or the system's)")
    result = make("-n", "venv", f"LANE={lane}", f"VENV={tmp_path / 'venv'}", PATH=path, PYENV_ROOT=str(PYENV_ROOT))
    assert Path(venv_command(result, tmp_path / "venv")).parents[2] == PYENV_ROOT / "versions"


def test_make_finds_a_python_that_uv_manages(tmp_path):
    """uv's managed installations: a real interpreter, this test's own, laid out as `uv python install` does."""
    version = sys.version_info[:2]
    uv = Path(sys.executable).parent / "uv"  # make installs uv into every lane's venv
    if not uv.exists() or version not in LANE_OF:
        pytest.skip("needs uv in this venv and a Python that one lane takes alone")
    dotted = "%d.%d" % version
    if runs_on(SYSTEM_PATH, dotted):
        pytest.skip(f"Python {dotted} runs from {SYSTEM_PATH} here: nothing for uv to find")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "uv").symlink_to(uv)
    managed = tmp_path / "uv-python" / f"cpython-{sys.version.split()[0]}-linux-x86_64-gnu" / "bin"
    managed.mkdir(parents=True)
    (managed / f"python{dotted}").symlink_to(Path(sys._base_executable).resolve())
    result = make("-n", "venv", f"LANE={LANE_OF[version]}", f"VENV={tmp_path / 'venv'}",
                  PATH=f"{tmp_path / 'bin'}:{SYSTEM_PATH}", PYENV_ROOT=str(tmp_path / "no-pyenv"),
                  UV_PYTHON_INSTALL_DIR=str(tmp_path / "uv-python"))
    assert venv_command(result, tmp_path / "venv") == str(managed / f"python{dotted}")


def test_without_a_python_make_says_how_to_get_one_exits_2_and_creates_nothing(tmp_path):
    if runs_on(SYSTEM_PATH, "3.13"):
        pytest.skip(f"Python 3.13 runs from {SYSTEM_PATH} here")
    result = make("venv", "LANE=py313", f"VENV={tmp_path / 'venv'}", PATH=SYSTEM_PATH,
                  PYENV_ROOT=str(tmp_path / "no-pyenv"))
    assert result.returncode == 2
    first, second = result.stderr.splitlines()[:2]
    assert first == "jaxreplay: error: no Python 3.13 for LANE=py313 on PATH, in pyenv's versions or uv's"
    for way in ("pyenv install 3.13", "uv python install 3.13", "deadsnakes", "PYTHON=/path/to/python3.13"):
        assert way in second
    assert not (tmp_path / "venv").exists()
