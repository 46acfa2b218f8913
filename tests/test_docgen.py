"""The docs' config and metrics references are generated from the code and committed: they cannot drift."""

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

from jaxreplay.config import Config
from jaxreplay.tools import docgen
from jaxreplay.train.metric_keys import KEYS, METRICS

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_reference_pages_are_what_the_code_generates():
    result = subprocess.run([sys.executable, "-m", "jaxreplay.tools.docgen", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_check_fails_on_a_page_that_drifted(tmp_path):
    (tmp_path / "README.md").write_text((ROOT / "README.md").read_text())
    assert docgen.main(["--root", str(tmp_path)]) == 0
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 0
    page = tmp_path / docgen.PAGES["config"]
    page.write_text(page.read_text().replace("| `train.steps` | `int` | `300` |", "| `train.steps` | `int` | `200` |"))
    assert docgen.main(["--check", "--root", str(tmp_path)]) == 1


def test_the_sites_home_page_is_the_readme_with_its_links_relative_to_docs():
    """One text in two places: an edit to the README that is not regenerated fails --check."""
    home = docgen.home_page()
    assert "](docs/" not in home and "](demo.md)" in home
    assert home.splitlines()[1:] == (ROOT / "README.md").read_text().replace("](docs/", "](").splitlines()


def test_every_config_key_is_documented_with_its_default():
    page = docgen.config_page()
    for section in dataclasses.fields(Config):
        defaults = section.default_factory()
        for f in dataclasses.fields(defaults):
            value = getattr(defaults, f.name)
            keys = [f"{section.name}.{f.name}.{g.name}" for g in dataclasses.fields(value)] \
                if dataclasses.is_dataclass(value) else [f"{section.name}.{f.name}"]  # a sub-section: model.lora
            for key in keys:
                row = next((line for line in page.splitlines() if line.startswith(f"| `{key}` |")), None)
                assert row is not None, f"{key} is not in the config reference"
                assert "(undocumented)" not in row, f"{key}: give it a # comment line in config.py"
    assert "| `train.steps` | `int` | `300` | learner steps |" in page


def test_help_is_the_comment_lines_directly_above_a_field_and_its_trailing_comment():
    source = textwrap.dedent('''
        class XConfig:
            """Doc."""

            plain: int = 1
            # one line
            # and a second
            above: int = 2  # and a trailing one
            # a section comment, then a blank line

            after_blank: int = 3
            trailing: str = "a"  # only this
    ''')
    helps = docgen.field_help(source)
    assert helps[("XConfig", "above")] == "one line and a second; and a trailing one"
    assert helps[("XConfig", "plain")] == helps[("XConfig", "after_blank")] == ""
    assert helps[("XConfig", "trailing")] == "only this"


def test_the_metrics_reference_lists_every_registered_key_once():
    page = docgen.metrics_page()
    assert len(KEYS) == len(METRICS)  # no key registered twice
    for key, meaning, _ in METRICS:
        assert f"| `{key}` |" in page and meaning
