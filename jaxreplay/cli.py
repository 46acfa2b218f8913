"""`jaxreplay` command line: train (and resume) from a YAML config plus dotted overrides."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from jaxreplay.research import commands as research
from jaxreplay.train import guards
from jaxreplay.tools.xla_cpu import tune_cpu_compiler


MAX_MESSAGE = 1000  # characters of an error line: messages may quote user input


def one_line(text: str) -> str:
    """`text` as one line of at most MAX_MESSAGE characters: what every error report prints."""
    line = " ".join(text.split())
    return line if len(line) <= MAX_MESSAGE else f"{line[:MAX_MESSAGE - 3]}..."


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (exit code 2), like every other bad input."""

    def error(self, message: str):
        self.exit(2, f"jaxreplay: usage error: {one_line(f'{self.prog}: {message}')} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxreplay", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action=_VersionAction, help="print the versions this install runs on and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train, or resume the run in run.dir")
    train.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. replay.samples_per_insert=4")
    show = sub.add_parser("config", help="print the resolved config without running")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*")
    show.add_argument("--flat", action="store_true",
                      help="one dotted `key: value` line per setting, e.g. `train.steps: 300` (train.steps=300 as an "
                           "override)")
    ev = sub.add_parser("eval", help="pass@1 and pass@k of a checkpoint or HF model on the task's eval split")
    ev.add_argument("config")
    ev.add_argument("overrides", nargs="*")
    source = ev.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a run directory (or its checkpoints/)")
    source.add_argument("--hf", help="a Hugging Face model directory")
    ev.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ev.add_argument("--split", help="dataset split to evaluate (sets task.eval_split)")
    ev.add_argument("--k", type=_ks, default=(1,), help="pass@k values, e.g. 1,8 (max(k) samples per problem)")
    ev.add_argument("--batch", type=int, default=128, help="rows per sampling call")
    ev.add_argument("--out", help="write the results here as JSON")
    ex = sub.add_parser("export", help="a checkpoint's policy as a Hugging Face model directory")
    ex.add_argument("config", help="the run's config (with model.hf_path if it started from an HF model)")
    ex.add_argument("overrides", nargs="*")
    ex.add_argument("--checkpoint", required=True, help="a run directory (or its checkpoints/)")
    ex.add_argument("--out", required=True, help="the directory to write")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the saved weights")
    co = sub.add_parser("compile", help="compile the train step and samplers at full shapes, without weights, "
                                        "for a TPU slice or the local devices: memory per device against HBM")
    co.add_argument("config")
    co.add_argument("overrides", nargs="*")
    co.add_argument("--topology", help="a TPU slice, e.g. v5e-8 or v4-8 (needs the tpu extra), or 'local' for this "
                                       "machine's devices (default: the config's mesh.topology, else local)")
    co.add_argument("--json", help="also write the figures here as JSON")
    research.add_parsers(sub)
    return parser


class _VersionAction(argparse.Action):
    """`jaxreplay --version`: the dependency tier, resolved lazily (it imports nothing heavy first)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from jaxreplay.compat import describe_tier

        print(f"jaxreplay {_own_version()}: {describe_tier()}")
        parser.exit()


def _own_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("jaxreplay")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _ks(text: str) -> tuple[int, ...]:
    try:
        ks = tuple(int(k) for k in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not ks or min(ks) < 1:
        raise argparse.ArgumentTypeError(f"every k must be >= 1, got {text!r}")
    return ks


@contextlib.contextmanager
def _native_logs_to(path: Path):
    """Sends what C++ libraries (Reverb, TensorFlow, XLA) write to file descriptor 2 into
    `path`, keeping Python's own stderr (progress bar, errors) on the terminal. Exceptions
    that libraries' threads and callbacks drop (Orbax's closed event loop after a failed
    save, tensorboardX's flush thread) go there too, as they are not the run's outcome."""
    sys.stderr.flush()
    terminal = os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 2)
    previous, sys.stderr = sys.stderr, os.fdopen(os.dup(terminal), "w", buffering=1)
    hooks = sys.unraisablehook, threading.excepthook
    sys.unraisablehook = lambda u: _to_native_log(path, u.exc_type, u.exc_value, u.exc_traceback,
                                                  f"Exception ignored in: {u.object!r}" if u.object else u.err_msg)
    threading.excepthook = lambda a: _to_native_log(path, a.exc_type, a.exc_value, a.exc_traceback,
                                                    f"Exception in thread {a.thread.name if a.thread else '?'}")
    try:
        yield
    finally:
        sys.unraisablehook, threading.excepthook = hooks
        sys.stderr.close()
        sys.stderr = previous
        os.dup2(terminal, 2)
        os.close(terminal)


def _to_native_log(path: Path, kind, value, tb, header) -> None:
    with contextlib.suppress(Exception):  # the disk may be full: then it is dropped
        with open(path, "a") as log:
            log.write(f"{header}\n{''.join(traceback.format_exception(kind, value, tb))}")


def _quiet_exit() -> None:
    """After a write failure, the libraries' own failures at exit (tensorboardX flushing onto the
    full disk) are no news: stderr from here on goes nowhere (the run dir's native.log may be
    what cannot be written)."""
    sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    sys.stderr = open(os.devnull, "w")
    sys.unraisablehook = lambda u: None
    threading.excepthook = lambda a: None


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Overrides may also follow options (`compile CONFIG --topology v5e-8 train.remat=full`)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    """The command; `argv` None: this process is the command, and its stop signals stay
    flags until it exits (train, eval); given, they are put back on return (an in-process call)."""
    try:
        return _command(argv)
    finally:
        if argv is not None:
            guards.PreemptionNotice.release_process()


def _command(argv: list[str] | None) -> int:
    args = _parse(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow (under Reverb) is chatty on import
    if not args.debug:  # Orbax logs through absl what we report ourselves, as one line (CheckpointError)
        logging.getLogger("absl").setLevel(logging.CRITICAL)
    tune_cpu_compiler()  # before the first JAX computation
    from jaxreplay.config import ConfigError, load_config

    config = None
    try:
        if args.command in research.COMMANDS:
            return research.run(args)
        if args.command == "compile":
            return _compile(args)
        split = [f"task.eval_split={args.split}"] if getattr(args, "split", None) else []
        # The model evaluated is also the one whose tokenizer (and chat template) the task uses.
        hf = [f"model.hf_path={_yaml_string(args.hf)}"] if getattr(args, "hf", None) else []
        config = load_config(args.config, [*args.overrides, *split, *hf])
        if args.command in ("train", "eval"):  # stop signals become a flag the stages read, until the exit
            guards.PreemptionNotice.for_process()
        if args.command == "eval":
            import json

            from jaxreplay.train.eval import run_eval

            results = run_eval(config, checkpoint=args.checkpoint, hf=args.hf, step=args.step, ks=args.k,
                               out=args.out, batch=args.batch)
            print(json.dumps({k: v for k, v in results.items() if k != "correct_per_problem"}))
            return 0
        if args.command == "export":
            from jaxreplay.tools.export import export_checkpoint

            out = export_checkpoint(config, args.checkpoint, args.out, step=args.step, dtype=args.dtype)
            print(f"wrote {out}")
            return 0
        if args.command == "config":
            import yaml

            from jaxreplay.config import flatten, to_dict

            if args.flat:
                flat = flatten(to_dict(config))
                print("".join(f"{key}: {_yaml_value(value)}\n" for key, value in flat.items()), end="")
            else:
                print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
            return 0
        from jaxreplay.train import rundir

        # One run per directory, refused before any work; a multi-host job's lock is taken by process 0
        # once it knows its index (driver.py), so here each process only checks the directory.
        hold = rundir.attach(config.run.dir) if config.distributed.enabled else \
            rundir.claim(config.run.dir, config.run.lease_s)
        with hold as run_dir, _native_logs_to(run_dir / "native.log"):
            from jaxreplay.compat import describe_tier  # imports JAX: after the checks above

            print(f"jaxreplay {_own_version()} on {describe_tier()}", flush=True)
            from jaxreplay.train.driver import train

            summary = train(config)
        if signum := guards.pending():  # after the run's last look at the flag: its final checkpoint is saved
            print(f"jaxreplay: {guards.KIND[signum]}: {guards.describe(signum)} as the run ended: its final "
                  f"checkpoint is step {summary['steps']} in {Path(config.run.dir) / 'checkpoints'}", file=sys.stderr)
            return guards.EXIT_CODE[signum]
        return 0
    except ConfigError as e:
        if args.debug:
            traceback.print_exc()
        print(f"jaxreplay: config error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # commands that leave Ctrl-C its default meaning
        print(f"jaxreplay: interrupted: {guards.describe(signal.SIGINT)}", file=sys.stderr)
        return guards.EXIT_CODE[signal.SIGINT]
    except guards.Preempted as e:  # a stop signal, after the final checkpoint where one was due
        print(f"jaxreplay: {e.kind}: {one_line(str(e))}", file=sys.stderr)
        return e.exit_code
    except Exception as e:  # one line for users; --debug for developers
        if args.debug:
            traceback.print_exc()
        if failure := _write_failure(e):  # disk full, read-only, quota: the path and the OS's word
            from jaxreplay.train.checkpoint import write_failure_message

            print(f"jaxreplay: error: {write_failure_message(failure, config.run.dir if config is not None else None)}",
                  file=sys.stderr, flush=True)
            if argv is None and not args.debug:
                _quiet_exit()
            return 2
        print(f"jaxreplay: error: {type(e).__name__}: {one_line(str(e))}", file=sys.stderr)
        return 2 if _bad_input(e) else 1


def _compile(args: argparse.Namespace) -> int:
    """`jaxreplay compile`: the report on stdout; exit 1 with one line when a program does not fit."""
    import json

    from jaxreplay.tools.aot import DoesNotFit, check_fits, compile_config, load_for_compile

    config = load_for_compile(args.config, args.overrides)
    topology = args.topology or config.mesh.topology
    report = compile_config(config, None if topology in (None, "local") else topology,
                            log=lambda line: print(line, file=sys.stderr))
    print("\n".join(report.lines()))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": args.config, **report.as_dict()}, indent=2) + "\n")
    try:
        check_fits(report)
    except DoesNotFit as e:
        print(f"jaxreplay: does not fit: {e}", file=sys.stderr)
        return 1
    return 0


def _yaml_value(value) -> str:
    """`value` as one line of YAML that an override (`key=value`) reads back as the same value."""
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _yaml_string(text: str) -> str:
    """`text` as a YAML scalar that reads back as exactly this string (an override's value is YAML)."""
    return "'" + text.replace("'", "''") + "'"


def _write_failure(error: Exception):
    from jaxreplay.train.checkpoint import write_failure

    return write_failure(error)


def _bad_input(error: Exception) -> bool:
    """Errors that name something wrong in what the user gave (a checkpoint, a dataset, a
    Hugging Face model directory): exit code 2, like a config error."""
    from jaxreplay.models.errors import HFModelError
    from jaxreplay.tasks.datasets import DatasetError
    from jaxreplay.replay.inprocess import DamagedCheckpoint
    from jaxreplay.train.checkpoint import CheckpointError

    return isinstance(error, (CheckpointError, DamagedCheckpoint, DatasetError, HFModelError))


if __name__ == "__main__":
    sys.exit(main())
