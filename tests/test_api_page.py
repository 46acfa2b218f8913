"""The public API page (docs/reference/api.md) lists import paths that work and are not deprecated:
every import line of its code blocks runs here, so the page cannot drift from the package."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "api.md"


def import_lines() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.DOTALL)
    return [line for block in blocks for line in block.splitlines()
            if re.match(r"(from jaxreplay[\w.]* import |import jaxreplay)", line)]


def test_every_import_on_the_api_page_works_without_a_warning():
    lines = import_lines()
    code = "import warnings\nwarnings.simplefilter('error')\n" + "\n".join(lines) + "\nprint('imported', len(dir()))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_page_covers_what_scripts_and_notebooks_use():
    imported = {name.strip() for line in import_lines() for name in line.split(" import ", 1)[1].split(",")}
    wanted = {"load_config", "train", "init_params", "forward", "load_hf_model", "make_task", "make_sampler",
              "make_train_step", "build_tables", "serve", "reader_for", "writer_for", "run_eval"}
    assert wanted <= imported, sorted(wanted - imported)


def test_the_old_paths_the_page_names_warn_with_the_new_path_it_gives():
    text = " ".join(PAGE.read_text().split("## Old paths", 1)[1].split())
    old = re.search(r"`(from jaxreplay\.models import [^`]+)` warns `([^`]+)`", text)
    code = f"import warnings\nwarnings.simplefilter('error')\n{old.group(1)}"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert f"DeprecationWarning: {old.group(2)}" in result.stderr, result.stderr[-2000:]
