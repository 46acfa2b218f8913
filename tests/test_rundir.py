"""One run per run.dir: a usable directory or one line naming run.dir, and a lock a second run cannot take."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from jaxreplay.config import ConfigError
from jaxreplay.train import rundir
from test_bad_input import read_only_dir

HOLD = textwrap.dedent("""
    import sys, time
    from jaxreplay.train import rundir
    with rundir.claim(sys.argv[1]):
        print("held", flush=True)
        time.sleep(600)
""")


def hold_in_another_process(directory):
    """A process that holds the lock on `directory` until killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_run_dir_errors_are_config_errors_naming_run_dir(tmp_path):
    (tmp_path / "afile").write_text("")
    for path, why in [(tmp_path / "afile", "exists and is not a directory"),
                      (tmp_path / "afile" / "run", "lies under a file"),
                      (read_only_dir(tmp_path), "is not writable")]:
        with pytest.raises(ConfigError, match=f"^run.dir: .*{why}"):
            rundir.create(path)


def test_a_second_run_is_refused_naming_the_holders_pid(tmp_path):
    holder = hold_in_another_process(tmp_path)
    try:
        with pytest.raises(rundir.RunDirError, match=rf"in use by another run \(process {holder.pid} on "):
            with rundir.claim(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_a_killed_runs_lock_does_not_block_the_resume(tmp_path):
    holder = hold_in_another_process(tmp_path)
    holder.send_signal(signal.SIGKILL)  # no cleanup runs: the lock file stays, with the dead PID in it
    holder.wait()
    assert (tmp_path / rundir.LOCK_FILE).read_text().split()[0] == str(holder.pid)
    with rundir.claim(tmp_path):
        assert (tmp_path / rundir.LOCK_FILE).read_text().split()[0] == str(os.getpid())


def test_claims_nest_in_one_process_and_the_lock_goes_with_the_outermost(tmp_path):
    probe = [sys.executable, "-c", "import sys; from jaxreplay.train import rundir\n"
             "with rundir.claim(sys.argv[1]): pass", str(tmp_path)]
    with rundir.claim(tmp_path):
        with rundir.claim(tmp_path / "."):  # the CLI claims, then the driver it calls
            pass
        assert subprocess.run(probe, capture_output=True, timeout=60).returncode != 0  # still held
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 0


@pytest.mark.parametrize("placement", [[], ["mesh.actor_devices=1"]], ids=["colocated", "disaggregated"])
def test_the_driver_takes_the_lock_before_any_work(tmp_path, placement):
    """Called in code, not through the CLI, the driver still refuses a directory in use."""
    from jaxreplay.config import load_config
    from jaxreplay.train.driver import train
    from test_train import DEMO

    holder = hold_in_another_process(tmp_path)
    try:
        with pytest.raises(rundir.RunDirError, match=f"process {holder.pid}"):
            train(load_config(DEMO, [f"run.dir={tmp_path}", *placement]), log=lambda _: None)
        assert sorted(p.name for p in tmp_path.iterdir()) == [rundir.LOCK_FILE]  # nothing written
    finally:
        holder.kill()
        holder.wait()
