"""launch/colab_demo.ipynb on a Colab-like runtime, so it cannot rot.

The runtime is a fresh Python 3.12 venv with current numpy and jax (constraints/default.txt) and a
kernel that has imported both before anything of jaxreplay's, as Colab's has. The notebook's own
install cell brings jaxreplay from a copy of this checkout; then it runs top to bottom (CPU, tiny
model). A last cell checks, inside the kernel, that numpy, jax and jaxlib are still the versions the
kernel had imported, on disk and in memory: installing anything else over them can kill the kernel.
The other two tests show each guard failing: a cell that installs an older numpy fails that check, and
the install cell stops rather than upgrade a package the kernel imported. The notebook runs in the venv's own interpreter, the same from any lane, so only the default-tier
lane (Python >= 3.12) runs it.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "launch" / "colab_demo.ipynb"
CONSTRAINTS = ROOT / "constraints" / "default.txt"
KERNEL_PACKAGES = ("numpy", "jax", "jaxlib")

COLAB_KERNEL = """# The runtime as Colab starts it: numpy and jax imported before anything else.
import importlib.metadata, json, sys
import numpy, jax
assert sys.prefix == {venv!r}, f"the kernel runs {{sys.executable}}, not the test's venv"
KERNEL_BEFORE = {{name: importlib.metadata.version(name) for name in {packages!r}}}
print("KERNEL_BEFORE", json.dumps(KERNEL_BEFORE))
"""

VERSIONS_KEPT = """# What the kernel had imported is still what is installed, and what is loaded.
import importlib.metadata, json, jaxlib
installed = {name: importlib.metadata.version(name) for name in KERNEL_BEFORE}
loaded = {"numpy": numpy.__version__, "jax": jax.__version__, "jaxlib": jaxlib.__version__}
assert installed == KERNEL_BEFORE == loaded, (
    f"the notebook changed the kernel's packages: imported {KERNEL_BEFORE}, installed now {installed}, "
    f"loaded {loaded}")
print("KERNEL_AFTER", json.dumps(installed))
"""

# Run by the venv's interpreter: executes a notebook in a kernel of that interpreter and writes
# it back with its outputs, also when a cell fails (nbclient's error, with the cell's traceback,
# goes to stderr).
DRIVER = """
import sys, nbformat
from nbclient import NotebookClient
source, executed, cwd, timeout = sys.argv[1:]
nb = nbformat.read(source, as_version=4)
try:
    NotebookClient(nb, timeout=int(timeout), kernel_name="python3", resources={"metadata": {"path": cwd}}).execute()
finally:
    nbformat.write(nb, executed)
"""


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            pins[_name(name)] = version.strip()
    return pins


def _python312():
    for candidate in ("/root/.pyenv/versions/3.12.1/bin/python3.12", shutil.which("python3.12")):
        if candidate and Path(candidate).is_file():
            probe = subprocess.run([candidate, "-c", "import sys, venv; print(sys.version_info[:2] == (3, 12))"],
                                   capture_output=True, text=True, timeout=60)
            if probe.stdout.strip() == "True":
                return candidate
    return None


def _pip(python, *args, timeout=600, fast=False):
    """`pip install` into `python`'s environment. fast: through uv where this interpreter has it (make's
    lanes), for building the runtime only: what the notebook's cells install goes through pip, as on Colab."""
    installer = ([sys.executable, "-m", "uv", "pip", "install", "--python", str(python)]
                 if fast and importlib.util.find_spec("uv") else [str(python), "-m", "pip", "install"])
    done = subprocess.run([*installer, "--quiet", *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(installer[:-1])} {' '.join(args)} failed:\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    """A fresh 3.12 venv holding what a Colab runtime holds before our notebook runs: current numpy
    and jax, and a Jupyter kernel. Beside it, `rest.txt`: constraints/default.txt without the packages
    the venv already has, so what the notebook adds is the default tier's versions while the notebook's
    own pins alone hold what the kernel imported."""
    if sys.version_info < (3, 12):
        pytest.skip("CI runs this once, in the default-tier lane: the runtime is its own 3.12 venv from any lane")
    python312 = _python312()
    if python312 is None:
        pytest.skip("no python3.12 here: the Colab runtime the notebook test recreates is Python 3.12")
    venv = tmp_path_factory.mktemp("colab") / "venv"
    subprocess.run([python312, "-m", "venv", str(venv)], check=True, timeout=300)
    _pip(venv / "bin" / "python", "--constraint", str(CONSTRAINTS), "numpy", "jax", "ipykernel", "nbclient", fast=True)
    freeze = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "freeze"], capture_output=True, text=True,
                            check=True, timeout=120).stdout
    present = {_name(line.split("==")[0]) for line in freeze.splitlines() if "==" in line}
    (venv.parent / "rest.txt").write_text("".join(f"{name}=={version}\n" for name, version in _pins().items()
                                                  if name not in present))
    return venv


def _name(distribution: str) -> str:
    return distribution.strip().lower().replace("_", "-")


def _installed(venv, name: str) -> str:
    probe = f"import importlib.metadata as m; print(m.version({name!r}))"
    return subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, check=True,
                          timeout=60).stdout.strip()


def _notebook_from_checkout(tmp_path):
    """The notebook's cells with SOURCE set to a copy of this checkout (without build outputs or venvs),
    and the install cell."""
    checkout = tmp_path / "jaxreplay"
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "runs", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", ".jax-cache"))
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    install = next(c for c in cells if c["cell_type"] == "code")
    lines = "".join(install["source"]).split("\n")
    assert lines.count('SOURCE = ""') == 1, "the install cell names its source in one line: SOURCE = \"\""
    install["source"] = "\n".join(f"SOURCE = {str(checkout)!r}" if line == 'SOURCE = ""' else line for line in lines)
    return cells, install


def _execute(venv, cells, workdir, env_extra=(), timeout=480):
    """Runs `cells` (notebook cells, or source strings for new code cells) in a fresh kernel of `venv`.
    Returns the driver's completed process and the executed cells."""
    cells = [{"cell_type": "code", "execution_count": None, "id": f"test{i}", "metadata": {}, "outputs": [],
              "source": cell} if isinstance(cell, str) else cell for i, cell in enumerate(cells)]
    nb = json.loads(NOTEBOOK.read_text())
    nb["cells"] = cells
    source, executed = workdir / "in.ipynb", workdir / "out.ipynb"
    source.write_text(json.dumps(nb))
    # The venv's own site only; and bytecode written on first import, as on Colab (the runtime is built without it).
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env.update(env_extra)
    done = subprocess.run([str(venv / "bin" / "python"), "-c", DRIVER, str(source), str(executed), str(workdir),
                           str(timeout)], capture_output=True, text=True, env=env, cwd=workdir, timeout=timeout + 120)
    cells = json.loads(executed.read_text())["cells"] if executed.exists() else []
    return done, cells


def _errors(cells) -> str:
    """The executed cells' errors, one line each."""
    return "\n".join(f"cell {cell['id']}: {o['ename']}: {o['evalue']}" for cell in cells
                     for o in cell.get("outputs", []) if o["output_type"] == "error")


def _text(cell) -> str:
    """A cell's printed text (nbformat stores it as a string or a list of lines)."""
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


def _kernel(venv):
    return COLAB_KERNEL.format(venv=str(venv), packages=KERNEL_PACKAGES)


@pytest.mark.slow
@pytest.mark.needs_sidecar
def test_colab_notebook_runs_on_a_colab_like_runtime_and_keeps_its_numpy_and_jax(runtime, tmp_path):
    """Part 4 runs Reverb through its sidecar under the Python `make venv-sidecar` built (the notebook's
    own uv install of Python 3.11 needs the network)."""
    from jaxreplay.replay.sidecar import find_python

    cells, install = _notebook_from_checkout(tmp_path)
    done, executed = _execute(runtime, [_kernel(runtime), *cells, VERSIONS_KEPT], tmp_path, {
        "JAXREPLAY_NOTEBOOK_TINY": "1", "JAXREPLAY_NOTEBOOK_RUNS": str(tmp_path / "runs"),
        "PIP_CONSTRAINT": str(runtime.parent / "rest.txt"), "JAXREPLAY_NOTEBOOK_REVERB_PYTHON": find_python()[0]})
    assert done.returncode == 0, _errors(executed) or done.stderr[-6000:]

    before = json.loads(_text(executed[0]).split("KERNEL_BEFORE ")[1])
    pins = _pins()
    assert before == {name: pins[name] for name in KERNEL_PACKAGES}  # the current releases, as on Colab
    assert json.loads(_text(executed[-1]).split("KERNEL_AFTER ")[1]) == before
    assert "jaxreplay 0.1.0 | jax " + pins["jax"] in _text(next(c for c in executed if c["id"] == install["id"]))
    assert (runtime / "lib" / "python3.12" / "site-packages" / "jaxreplay").is_dir()  # installed, not the checkout

    outputs = [o for cell in executed for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o["output_type"] == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2  # learning curve, ratio comparison
    final = _text(next(c for c in executed if "# Final figures of each run." in "".join(c["source"])))
    assert [line.split(" {")[0] for line in final.splitlines()] == ["spi 1", "spi 2", "spi 4"]
    for spi in (1, 2, 4):
        assert (tmp_path / "runs" / f"spi{spi}" / "summary.json").exists()
    lora = _text(next(c for c in executed if "export_checkpoint(lora_config" in "".join(c["source"])))
    assert "LORA {'eval/accuracy_start'" in lora and (tmp_path / "runs" / "lora" / "summary.json").exists()
    exported = json.loads(lora.split("EXPORT ")[1].strip().replace("'", '"'))
    assert {"config.json", "model.safetensors", "adapter/adapter_config.json",
            "adapter/adapter_model.safetensors"} <= set(exported)  # merged for transformers, adapters for PEFT
    reverb = json.loads((tmp_path / "runs" / "reverb" / "summary.json").read_text())
    assert reverb["replay/backend"] == "reverb" and reverb["steps"] > 0
    assert "REPLAY Reverb (sidecar): {'replay/backend': 'reverb'" in _text(executed[-2])


@pytest.mark.slow
def test_the_version_check_fails_when_a_cell_installs_an_older_numpy(runtime, tmp_path):
    """What the notebook test would see if a notebook cell downgraded numpy in the kernel."""
    downgrade = (f"import subprocess, sys\nsubprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', "
                 f"'numpy<{_pins()['numpy']}'], check=True, timeout=600)")
    try:
        done, executed = _execute(runtime, [_kernel(runtime), downgrade, VERSIONS_KEPT], tmp_path, timeout=300)
        assert done.returncode != 0
        (error,) = [o for o in executed[-1]["outputs"] if o["output_type"] == "error"]
        assert error["ename"] == "AssertionError"
        assert error["evalue"].startswith("the notebook changed the kernel's packages: imported {'numpy': "
                                          f"'{_pins()['numpy']}'")
    finally:  # the module's venv is shared: put its numpy back
        _pip(runtime / "bin" / "python", "--constraint", str(CONSTRAINTS), "numpy")


@pytest.mark.slow
def test_the_install_cell_fails_rather_than_upgrade_a_package_the_kernel_imported(runtime, tmp_path):
    """The kernel has imported a tqdm older than jaxreplay's floor: pip would upgrade it under the live
    kernel, so the install cell stops with pip's conflict and leaves it as it was."""
    python = runtime / "bin" / "python"
    _pip(python, "tqdm==4.65.0")  # jaxreplay needs tqdm>=4.66
    try:
        _, install = _notebook_from_checkout(tmp_path)
        done, executed = _execute(runtime, [_kernel(runtime) + "import tqdm\n", install], tmp_path, {
            "PIP_CONSTRAINT": str(runtime.parent / "rest.txt")}, timeout=300)
        assert done.returncode != 0
        (error,) = [o for o in executed[-1]["outputs"] if o["output_type"] == "error"]
        assert error["ename"] == "RuntimeError" and error["evalue"].startswith("pip install --constraint")
        assert "ResolutionImpossible" in error["evalue"] and "tqdm" in error["evalue"]
        assert _installed(runtime, "tqdm") == "4.65.0"
    finally:  # the module's venv is shared: put tqdm back
        _pip(python, "--constraint", str(CONSTRAINTS), "tqdm")
