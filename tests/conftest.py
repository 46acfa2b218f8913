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
"""

import os
from collections import Counter
from importlib.metadata import version
from pathlib import Path

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


def pytest_collection_modifyitems(items) -> None:
    """Files with the most end-to-end runs (marked slow) first, each file's tests in their own
    order: make test's pytest-xdist workers take whole files in this order
    (--no-loadscope-reorder), so the long files start early and the short ones fill in
    around them, instead of one long file ending the run on a single worker."""
    slow_runs = Counter(item.path for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow_runs[item.path])  # stable: keeps each file's order


def cpu_devices_env(count: int) -> dict[str, str]:
    """The environment of a process a test starts on `count` CPU devices: this suite's
    settings (cache, optimisation level) with XLA told to make that many host devices."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}".strip()
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags, "TF_CPP_MIN_LOG_LEVEL": "3"}
