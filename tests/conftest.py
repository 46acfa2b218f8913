"""What every test, and every process a test starts, shares: XLA's persistent compilation cache
and XLA's backend optimisation level 0.

The suite compiles the same small programs many times over (the same tiny configs in many
tests, and in the `jaxreplay train` processes tests start); compiled once and loaded after,
test_train.py takes half the CPU time on 2 cores. Entries are keyed by the program, the
jax/jaxlib version, the backend and the flags, so lanes and runs share the folder.

Only from jax 0.8 (the default tier): on the Reverb lane's jax 0.4.34, programs loaded from
the cache within one suite run trained differently from freshly compiled ones (every group
of test_replay_knobs scored alike), so that lane compiles everything.
Set JAX_COMPILATION_CACHE_DIR to use another folder (or "" for none).

Most tests compile small programs and run them a few times, so compiling is most of their
time; at optimisation level 0 XLA compiles them about 1.6x faster (cold cache, one process:
tests/test_learner_scale.py 158 s -> 95 s; test_sampling, test_learner and test_model
207 s -> 136 s), and the end-to-end runs take as long (test_train + test_crash 206 s ->
210 s). The user's entry points (`make demo`, the CLI, benchmarks) keep XLA's default,
and so does a process a test starts with an XLA_FLAGS of its own; those that need several CPU
devices take the suite's flags with a device count added (`cpu_devices_env`). An XLA_FLAGS
that already names the level keeps its own.

CI's lanes split the suite by what each test needs, declared here once by marker (pyproject.toml):
`needs_reverb`, `needs_tf`, `needs_torch` (skipped where that is not installed) and `tier` (checks
what differs between the tiers). The default lane runs every test; the Reverb lane
(`-m "needs_reverb or needs_tf or needs_torch or tier"`) only those, so no tier-independent test
runs twice. `--lane-check` (CI's default lane) fails a test that skips for want of Reverb,
TensorFlow or torch without the marker that sends it to the Reverb lane: it would run nowhere.
`needs_reasoning_gym` (the reasoning_gym extra, whose pycosat builds only with a C compiler) and
`needs_skyrl` (the skyrl extra) and `needs_serve` (the serve extra's aiohttp and the test extra's openai
client) are the default lane's own: CI installs them there, tests skip
without them, and `--lane-check` fails such a skip.
`needs_sidecar` tests run Reverb in its sidecar process (jaxreplay/replay/sidecar.py) and skip
where no Python for it is found; CI builds one (`make venv-sidecar`) for the default lane, whose
`--lane-check` therefore fails such a skip. `reverb` tests run on both lanes: in process on the
Reverb lane, through the sidecar on the default lane.
"""

import importlib.util
import os
from collections import Counter
from importlib.metadata import version
from pathlib import Path

import pytest

CACHE_FROM_JAX = (0, 8)
FAST_COMPILE = "--xla_backend_optimization_level"


def _release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2])


# Set before jax is imported (tests import it after this file), and inherited by subprocesses.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ and _release(version("jax")) >= CACHE_FROM_JAX:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(Path(__file__).resolve().parents[1] / ".jax-cache")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
if FAST_COMPILE not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE}=0".strip()


# A need's marker: the modules it needs, and the words a skip for want of them says.
NEEDS = {
    "needs_reverb": (("reverb",), ("reverb",)),
    "needs_tf": (("tensorflow", "tensorflow_datasets"), ("tensorflow", "tfds")),
    "needs_torch": (("torch",), ("torch",)),
}
# Needs CI's default lane installs beside the `test` extra (.ci/run: EXTRAS), that a fresh machine may lack:
# skipped where missing, and under --lane-check such a skip fails (that lane should have it).
DEFAULT_LANE_NEEDS = {
    "needs_reasoning_gym": (("reasoning_gym",), "pip install 'jaxreplay[reasoning_gym]'; pycosat needs a C compiler"),
    "needs_skyrl": (("skyrl_gym",), "pip install 'jaxreplay[skyrl]'"),
    "needs_serve": (("aiohttp", "openai"), "pip install 'jaxreplay[serve,test]'"),
}
REVERB_ANYWHERE = "reverb"  # Reverb in process (the Reverb lane) or through its sidecar (the default lane): both
LANE_MARKS = (*NEEDS, "tier", REVERB_ANYWHERE)  # the Reverb lane's selection: CI's -m is these joined by "or"
SIDECAR = "needs_sidecar"  # the default lane's, with the sidecar's Python built


def _missing(marker: str) -> bool:
    return any(importlib.util.find_spec(module) is None for module in NEEDS[marker][0])


def pytest_addoption(parser) -> None:
    parser.addoption("--lane-check", action="store_true",
                     help="fail a test that skips for want of Reverb, TensorFlow or torch but lacks the needs_* "
                          "marker that sends it to the Reverb lane (CI's default lane)")


def pytest_collection_modifyitems(items) -> None:
    """A needs_* test skips where what it needs is missing. Then files with the most end-to-end
    runs (marked slow) first, each file's tests in their own order: make test's pytest-xdist
    workers take whole files in this order (--no-loadscope-reorder), so the long files start
    early and the short ones fill in around them, instead of one long file ending the run on a
    single worker."""
    missing = {marker: _missing(marker) for marker in NEEDS}
    for item in items:
        for marker in NEEDS:
            if missing[marker] and item.get_closest_marker(marker):
                item.add_marker(pytest.mark.skip(reason=f"{marker}: {' or '.join(NEEDS[marker][0])} "
                                                        "is not installed here"))
    for marker, (modules, how) in DEFAULT_LANE_NEEDS.items():
        if any(importlib.util.find_spec(m) is None for m in modules):
            for item in items:
                if item.get_closest_marker(marker):
                    item.add_marker(pytest.mark.skip(reason=f"{marker}: {' or '.join(modules)} is not installed "
                                                            f"here ({how}: docs/install.md)"))
    sidecar_tests = [item for item in items if item.get_closest_marker(SIDECAR) or
                     (item.get_closest_marker(REVERB_ANYWHERE) and missing["needs_reverb"])]
    if sidecar_tests and (why := _no_sidecar()):
        for item in sidecar_tests:
            item.add_marker(pytest.mark.skip(reason=f"{SIDECAR}: {why}"))
    slow_runs = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_runs[item.path])  # stable: keeps each file's order


def _no_sidecar() -> str:
    """Why Reverb's sidecar cannot run here ("" where it can)."""
    from jaxreplay.config import ConfigError
    from jaxreplay.replay.sidecar import find_python
    try:
        find_python()
    except ConfigError as e:
        return str(e)
    return ""


def _unmarked_needs(reason: str, has_marker) -> list[str]:
    """What a skip's reason says the test wants and is missing here, where the test carries
    no marker of the Reverb lane's selection (with one, that lane runs it)."""
    if any(has_marker(marker) for marker in LANE_MARKS):
        return []
    reason = reason.lower()
    return [marker for marker, (_, words) in NEEDS.items() if any(word in reason for word in words) and _missing(marker)]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.skipped and item.config.getoption("lane_check") and isinstance(report.longrepr, tuple):
        if report.longrepr[2].startswith(f"Skipped: {SIDECAR}:") or report.longrepr[2].startswith(f"{SIDECAR}:"):
            report.outcome = "failed"
            report.longrepr = f"--lane-check: skipped ({report.longrepr[2]}): CI's default lane builds its Python"
            return
        if unmarked := _unmarked_needs(report.longrepr[2], item.get_closest_marker):
            report.outcome = "failed"
            report.longrepr = (f"--lane-check: skipped ({report.longrepr[2]}) without @pytest.mark."
                               f"{' or '.join(unmarked)}, so no CI lane runs it")
        elif wanted := [m for m in DEFAULT_LANE_NEEDS if item.get_closest_marker(m) and m in report.longrepr[2]]:
            report.outcome = "failed"
            report.longrepr = (f"--lane-check: skipped ({report.longrepr[2]}), but CI's default lane installs "
                               f"what {' and '.join(wanted)} needs (.ci/run)")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """The same check for a module that skips whole (a module-level importorskip): its
    `pytestmark` must name the need, which the Reverb lane selects it by."""
    report = (yield).get_result()
    if report.skipped and collector.config.getoption("lane_check") and isinstance(report.longrepr, tuple):
        text = Path(collector.path).read_text() if Path(collector.path).is_file() else ""
        if unmarked := _unmarked_needs(report.longrepr[2], lambda marker: f"pytest.mark.{marker}" in text):
            report.outcome = "failed"
            report.longrepr = (f"--lane-check: {collector.path.name} skips whole ({report.longrepr[2]}) without "
                               f"pytestmark = pytest.mark.{' or '.join(unmarked)}, so no CI lane runs it")


def pytest_terminal_summary(terminalreporter) -> None:
    """The lane's share of the split, by marker: CI's log shows what each lane ran."""
    seen = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) in ("setup", "call") and hasattr(report, "keywords"):
                seen[report.nodeid] = report.keywords
    if not seen:
        return
    kinds = Counter(next((m for m in LANE_MARKS if m in keywords), "tier-independent") for keywords in seen.values())
    # No outcome words: tests that run pytest themselves read their child's summary for them.
    terminalreporter.write_line(f"lane split: {len(seen)} tests here, by need: " + ", ".join(
        f"{kind} {kinds[kind]}" for kind in (*LANE_MARKS, "tier-independent") if kinds[kind]))


def cpu_devices_env(count: int) -> dict[str, str]:
    """The environment of a process a test starts on `count` CPU devices: this suite's
    settings (cache, optimisation level) with XLA told to make that many host devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "TF_CPP_MIN_LOG_LEVEL": "3"}
