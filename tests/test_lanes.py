"""CI's lanes split the suite by what tests need (tests/conftest.py): a test that skips on the
default lane for want of Reverb, TensorFlow or torch must carry the marker that sends it to the
Reverb lane, or it would run nowhere; `--lane-check` fails it, and a skip for want of what the
default lane installs itself (reasoning-gym). Each case runs pytest on a small suite of its own
under this suite's conftest."""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import LANE_MARKS

ROOT = Path(__file__).resolve().parents[1]

if importlib.util.find_spec("reverb") is not None:
    pytest.skip("dm-reverb is installed here: no test skips for want of it", allow_module_level=True)


UNMARKED = """
import pytest

def test_reads_a_reverb_table():
    pytest.importorskip("reverb", reason="needs dm-reverb")
"""

MARKED = """
import pytest

@pytest.mark.needs_reverb
def test_reads_a_reverb_table():
    import reverb
"""

WHOLE_MODULE = """
import pytest

reverb = pytest.importorskip("reverb", reason="needs dm-reverb")

def test_reads_a_reverb_table():
    pass
"""

REASONING_GYM = """
import pytest

@pytest.mark.needs_reasoning_gym
def test_draws_from_a_generator():
    import reasoning_gym
"""

# A plugin (-p) that makes reasoning_gym missing in that pytest, installed or not: find_spec gives None.
HIDE_REASONING_GYM = "import sys\nsys.modules['reasoning_gym'] = None\n"

WHOLE_MODULE_MARKED = WHOLE_MODULE.replace("\ndef test", "pytestmark = pytest.mark.needs_reverb\n\ndef test")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """One file per case, beside copies of this suite's conftest and markers."""
    suite = tmp_path_factory.mktemp("suite")
    shutil.copy(ROOT / "tests" / "conftest.py", suite / "conftest.py")
    shutil.copy(ROOT / "pyproject.toml", suite / "pyproject.toml")  # the markers
    for name, source in [("unmarked", UNMARKED), ("marked", MARKED), ("whole_module", WHOLE_MODULE),
                         ("whole_module_marked", WHOLE_MODULE_MARKED)]:
        (suite / f"test_{name}.py").write_text(source)
    return suite


def run(suite, *args, env=None):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-rA",
                           "--continue-on-collection-errors", "--rootdir", str(suite), str(suite), *args],
                          cwd=suite, capture_output=True, text=True, timeout=300, env=env)


def test_the_lane_check_fails_exactly_the_skips_for_want_of_reverb_that_no_marker_sends_to_its_lane(suite):
    result = run(suite, "--lane-check")
    summary = result.stdout[result.stdout.index("short test summary info"):]
    assert "FAILED test_unmarked.py::test_reads_a_reverb_table - --lane-check: skipped" in summary
    assert "without @pytest.mark.needs_reverb, so no CI lane runs it" in result.stdout
    assert "ERROR test_whole_module.py - --lane-check: test_whole_module.py skips whole" in summary
    assert "without pytestmark = pytest.mark.needs_reverb" in result.stdout
    assert "SKIPPED [1] test_marked.py:4: needs_reverb: reverb is not installed here" in summary
    assert "SKIPPED [1] test_whole_module_marked.py:4: needs dm-reverb" in summary
    assert "lane split: 2 tests here, by need: needs_reverb 1, tier-independent 1" in result.stdout
    assert "warning" not in result.stdout  # the markers are registered
    assert result.returncode == 1


def test_without_the_check_such_skips_are_skips(suite):
    result = run(suite)
    assert result.returncode == 0, result.stdout
    assert "4 skipped in" in result.stdout.splitlines()[-1]  # two tests, two modules


def test_ci_selects_the_reverb_lane_by_the_conftest_markers():
    """The split is declared by the markers alone: CI's Reverb lane takes exactly those."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r'^REVERB_LANE="(.*)"$', ci, re.M).group(1) == " or ".join(LANE_MARKS)
    assert """lane_tests reverb PYTEST_ARGS="-m '$REVERB_LANE'""" in ci
    assert 'lane_tests default PYTEST_ARGS="-rs --lane-check"' in ci


@pytest.fixture
def reasoning_gym_suite(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "test_generator.py").write_text(REASONING_GYM)
    (tmp_path / "hide_reasoning_gym.py").write_text(HIDE_REASONING_GYM)
    return tmp_path


def test_the_lane_check_fails_a_skip_for_want_of_reasoning_gym_which_the_default_lane_installs(reasoning_gym_suite):
    hidden = {**os.environ, "PYTHONPATH": str(reasoning_gym_suite)}
    result = run(reasoning_gym_suite, "-p", "hide_reasoning_gym", "--lane-check", env=hidden)
    assert result.returncode == 1, result.stdout
    assert "ERROR test_generator.py::test_draws_from_a_generator - --lane-check: skipped" in result.stdout  # at setup
    assert ("--lane-check: skipped (Skipped: needs_reasoning_gym: reasoning_gym is not installed here (pip install "
            "'jaxreplay[reasoning_gym]'; pycosat needs a C compiler: docs/install.md)), but CI's default lane "
            "installs what needs_reasoning_gym needs (.ci/run)") in result.stdout
    result = run(reasoning_gym_suite, "-p", "hide_reasoning_gym", env=hidden)  # a skip, with what to install
    assert result.returncode == 0 and "SKIPPED [1] test_generator.py" in result.stdout, result.stdout
    assert "pycosat needs a C compiler: docs/install.md" in result.stdout
    if importlib.util.find_spec("reasoning_gym") is not None:  # where it is installed the test runs
        assert "1 passed" in run(reasoning_gym_suite, "--lane-check").stdout


def test_ci_installs_the_reasoning_gym_skyrl_and_serve_extras_in_the_default_lane_alone():
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'extras() { if [ "$1" = default ]; then echo "EXTRAS=test,reasoning_gym,skyrl,serve"; fi; }' in ci
    assert "make venv LANE=$lane $(extras $lane)" in ci
    assert 'lane_tests default PYTEST_ARGS="-rs --lane-check" $(extras default)' in ci
