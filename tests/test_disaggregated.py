"""Disaggregated mode: two roles in two threads that stop together; end-to-end runs on 4 host devices."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from jaxreplay.replay.tables import ReplayTimeoutError
from jaxreplay.train.roles import RoleError, run_roles, wait_for
from conftest import cpu_devices_env

ROOT = Path(__file__).resolve().parents[1]


def until_stopped(log: list, name: str):
    def role(stop: threading.Event) -> None:
        while not stop.wait(0.01):
            pass
        log.append(name)
    return role


def test_a_role_that_returns_ends_the_run_and_stops_the_other():
    log = []
    run_roles({"learner": lambda stop: log.append("learner"), "actor": until_stopped(log, "actor")},
              join_timeout_s=5)
    assert sorted(log) == ["actor", "learner"]


@pytest.mark.parametrize("failing", ["actor", "learner"])
def test_an_error_in_either_role_stops_the_other_and_is_reported(failing):
    log = []

    def fail(stop):
        time.sleep(0.05)
        raise ValueError("boom")

    roles = {name: fail if name == failing else until_stopped(log, name) for name in ("actor", "learner")}
    start = time.monotonic()
    with pytest.raises(RoleError, match=f"{failing} thread failed: ValueError: boom") as info:
        run_roles(roles, join_timeout_s=5)
    assert isinstance(info.value.__cause__, ValueError)
    assert log == [n for n in ("actor", "learner") if n != failing]  # the other one stopped
    assert time.monotonic() - start < 2


def test_a_role_that_ignores_stop_is_reported_not_waited_for_forever():
    release = threading.Event()
    start = time.monotonic()
    with pytest.raises(RoleError, match="stuck thread"):
        run_roles({"done": lambda stop: None, "stuck": lambda stop: release.wait(10)}, join_timeout_s=0.2)
    release.set()
    assert time.monotonic() - start < 2


def test_wait_for_returns_the_value_none_on_stop_and_times_out_with_the_reason():
    stop = threading.Event()
    assert wait_for(lambda: 3, stop, 1.0, lambda: "x") == 3
    with pytest.raises(ReplayTimeoutError, match="waited 0.05s for the limiter"):
        wait_for(lambda: 0, stop, 0.05, lambda: "the limiter")
    threading.Timer(0.05, stop.set).start()
    assert wait_for(lambda: 0, stop, 10.0, lambda: "x") is None


@pytest.mark.tier
@pytest.mark.slow
def test_disaggregated_runs_on_4_host_devices():
    """Runs tests/test_disaggregated_multidevice.py where XLA sees 4 CPU devices."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_disaggregated_multidevice.py"],
        cwd=ROOT, env=cpu_devices_env(4), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
