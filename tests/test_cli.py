"""The `jaxreplay` command as a user meets it: help that explains every command and argument with
examples that parse, one error line format, `--version` and `--help` without JAX, and the
progress bar cleared before the run's last line on a terminal."""

from __future__ import annotations

import argparse
import ast
import fcntl
import os
import pty
import re
import select
import shlex
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from jaxreplay import MAX_MESSAGE, error_line
from jaxreplay.cli import _parser, described, main

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
# The demo shrunk to seconds of training (tests/test_train.py's TINY, with no warm start).
TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.d_ff=64", "task.max_digits=2", "task.eval_size=32", "warmstart.steps=0", "train.batch_size=16",
        "train.prompts_per_step=4", "train.group_size=4", "train.eval_every=4", "replay.max_size=64",
        "replay.min_size_to_sample=32", "checkpoint.every=4", "train.steps=4"]


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def examples(parser: argparse.ArgumentParser) -> list[list[str]]:
    """The `jaxreplay ...` lines of a parser's epilog, as argument lists (comments dropped)."""
    lines = [line.split("#")[0].strip() for line in (parser.epilog or "").splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("jaxreplay ") and "COMMAND" not in line]


# -- help ------------------------------------------------------------------------------------------

def test_every_command_is_listed_with_a_one_line_summary():
    help_text = _parser().format_help()
    names = commands()
    assert all(action.help for action in _parser()._actions), "jaxreplay --help: an argument without help"
    assert set(names) >= {"train", "config", "eval", "export", "compile", "sweep", "report", "theory"}
    for name in names:
        assert re.search(rf"^    {name} +\S", help_text, re.M), f"{name} has no summary in jaxreplay --help"


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_has_a_description_examples_and_help_on_every_argument(name):
    parser = commands()[name]
    help_text = parser.format_help()
    assert parser.description and len(parser.description.split("\n\n")[0]) < 120, name  # a one-line summary first
    assert "examples:" in help_text and examples(parser), f"jaxreplay {name} --help shows no example"
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"jaxreplay {name}: {action.dest} has no help"
        if action.default not in (None, False, argparse.SUPPRESS, [], ()):  # a default worth stating
            assert "default" in parser._get_formatter()._get_help_string(action), \
                f"jaxreplay {name}: {action.dest}'s default {action.default!r} is not shown"


def test_every_example_parses_and_names_files_that_exist():
    """Each example line of every --help is a command line the parser takes, with overrides only
    where overrides go; a config or sweep file it names (configs/...) is in the repository."""
    parser = _parser()
    lines = [args for p in [parser, *commands().values()] for args in examples(p)]
    assert len(lines) >= 20
    for args in lines:
        parsed, extra = parser.parse_known_args(args)
        assert not [e for e in extra if e.startswith("-")] and (not extra or hasattr(parsed, "overrides")), args
        for arg in args:
            if arg.startswith("configs/"):
                assert (ROOT / arg).is_file(), f"{' '.join(args)}: {arg} does not exist"


def test_the_same_mu_forms_everywhere():
    """`--mu 5.2`, `--mu 5,6,7` and a repeated `--mu` mean the same to theory and report."""
    parser = _parser()
    for command in (["theory"], ["report", "runs/a", "--out", "o"]):
        assert parser.parse_args([*command, "--mu", "5.2"]).mu == [5.2]
        assert parser.parse_args([*command, "--mu", "5,6,7"]).mu == [5.0, 6.0, 7.0]
        assert parser.parse_args([*command, "--mu", "5, 6", "--mu=7"]).mu == [5.0, 6.0, 7.0]
        assert parser.parse_args(command).mu is None


# -- one error format ------------------------------------------------------------------------------

def test_the_error_line_is_one_line_of_a_known_kind():
    assert error_line("config error", "unknown key x\n  (see   y)") == "jaxreplay: config error: unknown key x (see y)"
    assert len(error_line("error", "x" * 5000)) == MAX_MESSAGE
    with pytest.raises(ValueError, match="not an error kind"):
        error_line("does not fit", "train step")


def test_each_error_is_reported_by_its_kind():
    from jaxreplay.config import ConfigError
    from jaxreplay.replay.ports import PortInUseError
    from jaxreplay.tasks.datasets import DatasetError
    from jaxreplay.train.guards import Preempted
    from jaxreplay.train.rundir import RunDirError, RunDirInUse

    assert described(ConfigError("train.steps: must be > 0")) == ("config error", "train.steps: must be > 0")
    assert described(RunDirError("run.dir: x is not writable"))[0] == "config error"
    assert described(RunDirInUse("run.dir: x is in use by another run"))[0] == "error"  # a lock, not the config
    assert described(PortInUseError("replay.port: 1 is in use"))[0] == "error"
    assert described(DatasetError("train.jsonl: empty")) == ("error", "train.jsonl: empty")  # no type name
    assert described(ValueError("boom")) == ("error", "ValueError: boom")  # not ours: the type says what broke
    assert described(Preempted("SIGTERM: checkpoint at step 3", signal.SIGTERM)) == \
        ("stopped", "SIGTERM: checkpoint at step 3")
    assert described(Preempted("SIGINT (Ctrl-C)", signal.SIGINT))[0] == "interrupted"


def test_no_module_writes_an_error_line_of_its_own():
    """Every `jaxreplay: ...` line is made by `error_line`: no other string in the package starts so."""
    found = []
    for path in sorted((ROOT / "jaxreplay").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            first = node.values[0] if isinstance(node, ast.JoinedStr) and node.values else node
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and id(node) not in docstrings \
                    and first.value.startswith("jaxreplay: ") and path.name != "__init__.py":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"print error_line(kind, why) (from jaxreplay import error_line) instead: {found}"


def test_a_usage_error_is_one_line_naming_the_command_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["trian", DEMO])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.count("jaxreplay:") == 1, err
    assert err.startswith("jaxreplay: usage error: argument COMMAND: invalid choice: 'trian'") and \
        err.rstrip().endswith("; did you mean train? (see jaxreplay --help)")
    with pytest.raises(SystemExit) as e:
        main(["eval", DEMO, "--k", "0"])
    assert e.value.code == 2 and capsys.readouterr().err == \
        "jaxreplay: usage error: argument --k: every k must be >= 1, got '0' (see jaxreplay eval --help)\n"


def test_an_unknown_key_suggests_the_right_one(capsys):
    assert main(["config", DEMO, "train.stepz=3"]) == 2
    assert capsys.readouterr().err == "jaxreplay: config error: unknown key train.stepz (did you mean train.steps?)\n"
    assert main(["config", DEMO, "train.max_size=3"]) == 2  # a key of another section
    assert "(did you mean replay.max_size?)" in capsys.readouterr().err
    assert main(["config", DEMO, "trian.steps=3"]) == 2
    assert "unknown key trian (did you mean train?)" in capsys.readouterr().err
    assert main(["config", DEMO, "warmstart.zzz=3"]) == 2  # nothing close: the section's keys, not every key
    err = capsys.readouterr().err
    assert "(warmstart's keys: batch_size, cache_dir, learning_rate, steps, " in err and "train." not in err


def test_an_unknown_sweep_key_suggests_the_right_one(tmp_path, capsys):
    (tmp_path / "sweep.yaml").write_text(f"base: {DEMO}\nout: {tmp_path}\nseed: [0]\nsettings: {{a: []}}\n")
    assert main(["sweep", str(tmp_path / "sweep.yaml")]) == 2
    assert capsys.readouterr().err == "jaxreplay: config error: sweep: unknown key seed (did you mean seeds?)\n"


@pytest.mark.parametrize("command", ["config", "train"])
def test_a_sweep_file_given_for_a_runs_config_points_to_jaxreplay_sweep(tmp_path, capsys, command):
    sweep = ROOT / "configs" / "sweep_demo.yaml"
    run_dir = tmp_path / "run"
    assert main([command, str(sweep), f"run.dir={run_dir}"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"jaxreplay: config error: {sweep} is a sweep file (base, settings, seeds), not a "
                                 f"run's config: `jaxreplay sweep {sweep} --print` prints the command of each of its "
                                 "runs\n")
    assert not run_dir.exists()
    (tmp_path / "config.yaml").write_text("base: 3\n")  # a config naming an unknown section is still that
    assert main([command, str(tmp_path / "config.yaml")]) == 2
    assert "unknown key base" in capsys.readouterr().err


def test_a_run_dir_another_run_holds_is_an_error_not_a_config_error(tmp_path):
    """The config is sound: the same command runs once the other run ends. Still exit 2, one line."""
    from jaxreplay.train import rundir

    with rundir.claim(tmp_path):  # this process is the other run
        result = subprocess.run([sys.executable, "-m", "jaxreplay", "train", DEMO, *TINY, f"run.dir={tmp_path}"],
                                capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert result.stderr.startswith(f"jaxreplay: error: run.dir: {str(tmp_path)!r} is in use by another run "
                                    f"(process {os.getpid()} on "), result.stderr


# -- no JAX for --version and --help ---------------------------------------------------------------

NO_JAX = """
import sys
from jaxreplay.cli import main
for argv in {argvs!r}:
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, (argv, e.code)
heavy = sorted({{m.split(".")[0] for m in sys.modules}} & {{"jax", "jaxlib", "flax", "optax", "orbax", "numpy"}})
assert not heavy, heavy
"""


def test_version_and_help_import_no_jax():
    argvs = [["--version"], ["--help"], *([name, "--help"] for name in commands())]
    result = subprocess.run([sys.executable, "-c", NO_JAX.format(argvs=argvs)], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    version = result.stdout.splitlines()[0]
    assert version.startswith("jaxreplay ") and re.search(r"\bjax \d", version) and re.search(r"\bflax \d", version)


# -- the progress bar and the last line on a terminal ----------------------------------------------

def on_a_terminal(args: list[str], columns: int = 100, timeout: float = 240) -> tuple[int, str]:
    """Runs `args` with stdout and stderr on one pseudo-terminal `columns` wide (as `make demo`
    in a terminal); returns the exit status and every character the terminal received."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen(args, stdin=terminal, stdout=terminal, stderr=terminal, cwd=ROOT, close_fds=True)
    os.close(terminal)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if select.select([controller], [], [], 0.5)[0]:
                try:
                    chunk = os.read(controller, 1 << 16)
                except OSError:  # the terminal closed: the command has ended
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=10), out.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(controller)


@pytest.mark.slow
def test_the_done_line_starts_at_column_0_after_the_progress_bar(tmp_path):
    code, out = on_a_terminal([sys.executable, "-m", "jaxreplay", "train", DEMO, *TINY, f"run.dir={tmp_path}"])
    assert code == 0, out[-2000:]
    assert "train: 100%" in out  # the bar was drawn
    before, done, _ = out.rpartition("done: 4 steps")
    assert done, out[-2000:]
    assert before.endswith("\n"), repr(before[-300:])  # a fresh line: no bar fragment before `done:`
    assert "train:" not in out[len(before):], repr(out[len(before):])  # and no bar redrawn after it
