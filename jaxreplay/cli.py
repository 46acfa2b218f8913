"""`jaxreplay` command line: train (and resume) from a YAML config plus dotted overrides.

Building the parser and `--version` import nothing heavy (no JAX, no Flax): `jaxreplay --help`,
`jaxreplay train --help` and `jaxreplay --version` answer in a fraction of a second. Every failure
ends in one line, `jaxreplay: <kind>: <why>` (`jaxreplay.error_line`; `described` picks the kind).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import logging
import os
import re
import signal
import sys
import threading
import traceback
from pathlib import Path

from jaxreplay import ERROR_KINDS, error_line
from jaxreplay.research import commands as research
from jaxreplay.train import guards
from jaxreplay.tools.xla_cpu import tune_cpu_compiler

DESCRIPTION = "RL post-training of language models with experience replay, in JAX."
EXAMPLES = """\
examples:
  jaxreplay train configs/demo.yaml                   # the demo on CPU (what `make demo` runs)
  jaxreplay train configs/demo.yaml replay.samples_per_insert=4 run.dir=runs/spi4
  jaxreplay eval runs/demo --k 1,8                    # pass@1 and pass@8 of the run's latest checkpoint
  jaxreplay COMMAND --help                            # a command's arguments and examples

Errors end in one line on stderr, `jaxreplay: KIND: WHY`, KIND one of: config error, usage error,
error, stopped (SIGTERM), interrupted (SIGINT); exit status 2 where the input is at fault."""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions and examples as written; each argument's help ends with its default, where
    it has one the help does not already state."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default in (None, False, argparse.SUPPRESS) or "default" in text or
                (not action.option_strings and action.nargs != argparse.OPTIONAL)):
            return text
        shown = ",".join(map(str, default)) if isinstance(default, (tuple, list)) else default
        return f"{text} (default: {shown})"


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (exit code 2), like every other bad input."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        if choice := re.match(r"argument .+: invalid choice: '?(.+?)'? \(choose from (.+)\)$", message):
            known = [c.strip(" '") for c in choice.group(2).split(",")]
            if guess := difflib.get_close_matches(choice.group(1), known, n=1):
                message = f"{message}; did you mean {guess[0]}?"
        self.exit(2, error_line("usage error", f"{message} (see {self.prog} --help)") + "\n")


def command_parser(sub: argparse._SubParsersAction, name: str, summary: str, description: str,
                   examples: str) -> argparse.ArgumentParser:
    """A subcommand: `summary` in `jaxreplay --help`'s list, `description` and `examples` (one
    `jaxreplay ...` line each, `# comments` allowed) in its own --help."""
    return sub.add_parser(name, help=summary, description=f"{summary[0].upper()}{summary[1:]}.\n\n{description}",
                          epilog=f"examples:\n{examples}", formatter_class=HelpFormatter)


OVERRIDES = "dotted overrides section.key=value, e.g. train.steps=40 (also after options)"


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="jaxreplay", description=DESCRIPTION, epilog=EXAMPLES)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    parser.add_argument("--version", action=_VersionAction,
                        help="print jaxreplay's version and the versions it runs on (Python, JAX, Flax, ...) and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", title="commands",
                                parser_class=_Parser, help="one of these; `jaxreplay COMMAND --help` explains it")
    train = command_parser(
        sub, "train", "train a policy, or resume the run in run.dir",
        "Reads a YAML config, applies the overrides, and trains; the same command resumes from run.dir's latest\n"
        "checkpoint. SIGTERM or Ctrl-C saves a final checkpoint first. Metrics go to run.dir (metrics.jsonl,\n"
        "TensorBoard); the last line printed is `done: ...`.",
        "  jaxreplay train configs/demo.yaml\n"
        "  jaxreplay train configs/demo.yaml train.steps=40 replay.samples_per_insert=4 run.dir=runs/spi4\n"
        "  jaxreplay train configs/demo.yaml run.dir=runs/spi4      # resumes it")
    train.add_argument("config", help="the YAML config, e.g. configs/demo.yaml")
    train.add_argument("overrides", nargs="*", help=OVERRIDES)
    show = command_parser(
        sub, "config", "print the resolved config without running",
        "The config file with the overrides applied and every default filled in, checked as `train` would.",
        "  jaxreplay config configs/demo.yaml replay.samples_per_insert=4\n"
        "  jaxreplay config configs/demo.yaml --flat             # train.steps: 300, ...")
    show.add_argument("config", help="the YAML config, e.g. configs/demo.yaml")
    show.add_argument("overrides", nargs="*", help=OVERRIDES)
    show.add_argument("--flat", action="store_true",
                      help="one dotted `key: value` line per setting, e.g. `train.steps: 300` (train.steps=300 as an "
                           "override)")
    ev = command_parser(
        sub, "eval", "pass@1 and pass@k of a run's checkpoint or a Hugging Face model on the task's eval split",
        "Give a run directory (it holds config.yaml) to evaluate its checkpoint with the config it trained\n"
        "with, or a config file with --checkpoint RUN_DIR or --hf MODEL_DIR. Prints the results as one JSON line.",
        "  jaxreplay eval runs/demo                            # the run's latest checkpoint\n"
        "  jaxreplay eval runs/demo --k 1,8 --step 200 --out runs/demo/eval.json\n"
        "  jaxreplay eval configs/demo.yaml --checkpoint runs/demo train.group_size=8\n"
        "  jaxreplay eval configs/qwen2.5_0.5b_instruct_gsm8k_colab.yaml --hf models/qwen --split test")
    ev.add_argument("config", metavar="run_dir|config",
                    help="a run directory (local or gs://) holding config.yaml, or a YAML config file")
    ev.add_argument("overrides", nargs="*", help=OVERRIDES)
    source = ev.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", metavar="RUN_DIR",
                        help="a run directory (or its checkpoints/) to evaluate (default: the run_dir given)")
    source.add_argument("--hf", metavar="MODEL_DIR", help="a Hugging Face model directory to evaluate instead")
    ev.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ev.add_argument("--split", help="dataset split to evaluate (sets task.eval_split; default: the config's)")
    ev.add_argument("--k", type=_ks, default=(1,), help="pass@k values, e.g. 1,8 (max(k) samples per problem)")
    ev.add_argument("--batch", type=int, default=128, help="rows per sampling call")
    ev.add_argument("--out", metavar="FILE", help="also write the results here as JSON")
    ex = command_parser(
        sub, "export", "write a checkpoint's policy as a Hugging Face model directory",
        "Give a run directory (it holds config.yaml), or the run's config file with --checkpoint RUN_DIR.\n"
        "A run started from an HF model (model.hf_path) keeps that model's config.json keys and tokenizer.\n"
        "A LoRA run (model.lora) is written merged, and its adapters in PEFT's format in DIR/adapter.",
        "  jaxreplay export runs/demo --out exported/demo\n"
        "  jaxreplay export runs/qwen --out exported/qwen --step 400 --dtype bfloat16\n"
        "  jaxreplay export runs/qwen/config.yaml model.hf_path=models/qwen --checkpoint runs/qwen --out exported/qwen")
    ex.add_argument("config", metavar="run_dir|config",
                    help="a run directory (local or gs://) holding config.yaml, or the run's YAML config "
                         "(with model.hf_path if it started from an HF model)")
    ex.add_argument("overrides", nargs="*", help=OVERRIDES)
    ex.add_argument("--checkpoint", metavar="RUN_DIR",
                    help="a run directory (or its checkpoints/) (default: the run_dir given)")
    ex.add_argument("--out", required=True, metavar="DIR", help="the directory to write (required)")
    ex.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ex.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="cast the saved weights (default: as trained)")
    co = command_parser(
        sub, "compile", "compile the train step and samplers at full shapes, without weights: memory per device "
                        "against HBM",
        "For a TPU slice from any host (needs libtpu: the `tpu` extra, `make venv LANE=tpu`) or for this\n"
        "machine's devices. Exit status 1 when a program does not fit.",
        "  jaxreplay compile configs/demo.yaml                  # this machine's devices\n"
        "  jaxreplay compile configs/pod_v5e-8_qwen2.5_0.5b.yaml --json fit.json\n"
        "  jaxreplay compile configs/demo.yaml --topology v4-8 train.remat=full")
    co.add_argument("config", help="the YAML config, e.g. configs/pod_v5e-8_qwen2.5_0.5b.yaml")
    co.add_argument("overrides", nargs="*", help=OVERRIDES)
    co.add_argument("--topology", help="a TPU slice, e.g. v5e-8 or v4-8 (needs the tpu extra), or 'local' for this "
                                       "machine's devices (default: the config's mesh.topology, else local)")
    co.add_argument("--json", metavar="FILE", help="also write the figures here as JSON")
    se = command_parser(
        sub, "serve", "serve a checkpoint's policy or a Hugging Face model over HTTP (OpenAI routes, token in/out)",
        "Serves /v1/completions, /v1/chat/completions (streaming, tools), /inference/v1/generate (vLLM's token\n"
        "ids in and out), /v1/models and /health through the rollout engine: concurrent requests batch\n"
        "together. Loopback only unless JAXREPLAY_SERVE_TOKEN holds a bearer token. Needs the `serve` extra.\n"
        "SIGTERM stops taking requests and ends those in flight within --grace-s (docs/serving.md).",
        "  jaxreplay serve runs/demo --port 8000\n"
        "  jaxreplay serve configs/demo.yaml --checkpoint runs/demo --slots 64\n"
        "  jaxreplay serve configs/qwen2.5_0.5b_instruct_gsm8k_colab.yaml --hf models/qwen --max-tokens 512")
    se.add_argument("config", metavar="run_dir|config",
                    help="a run directory holding config.yaml, or a YAML config file")
    se.add_argument("overrides", nargs="*", help=OVERRIDES)
    served = se.add_mutually_exclusive_group()
    served.add_argument("--checkpoint", metavar="RUN_DIR", help="a run directory (or its checkpoints/) to serve")
    served.add_argument("--hf", metavar="MODEL_DIR", help="a Hugging Face model directory to serve instead")
    se.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    se.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; another one needs "
                                                        "JAXREPLAY_SERVE_TOKEN)")
    se.add_argument("--port", type=int, default=8000, help="port (0: any free one; the line `serving ... on URL` "
                                                           "names it)")
    se.add_argument("--slots", type=int, default=0, help="decode slots per engine (default: sampling.engine_slots, "
                                                         "else 16)")
    se.add_argument("--max-tokens", type=int, default=0,
                    help="the most tokens a request may draw (default: sampling.max_new_tokens)")
    se.add_argument("--max-prompt-len", type=int, default=0,
                    help="the longest prompt in tokens (default: model.max_seq_len - max tokens)")
    se.add_argument("--max-n", type=int, default=16, help="the most choices (n) a request may ask (default 16)")
    se.add_argument("--max-engines", type=int, default=4,
                    help="engines kept at once, one per (temperature, top_k, top_p) (default 4)")
    se.add_argument("--model-name", help="the model id clients name (default: the run dir or HF directory)")
    se.add_argument("--tool-call-format", choices=["qwen", "llama3", "pythonic"],
                    help="how the model writes tool calls (default: llama3 for Llama models, else qwen)")
    se.add_argument("--grace-s", type=float, default=30.0,
                    help="after SIGTERM, seconds requests in flight may run on (default 30)")
    research.add_parsers(sub, command_parser, OVERRIDES)
    return parser


class _VersionAction(argparse.Action):
    """`jaxreplay --version`: read from the installed packages' metadata, importing none of them."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

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
    # asyncio logs the exceptions of tasks it drops at a loop's shutdown (older Orbax's reads of a
    # damaged array after the restore has failed): same story, into the native log too.
    loop_log, native = logging.getLogger("asyncio"), logging.FileHandler(path, delay=True)
    propagates, loop_log.propagate = loop_log.propagate, False
    loop_log.addHandler(native)
    try:
        yield
    finally:
        loop_log.removeHandler(native)
        native.close()
        loop_log.propagate = propagates
        sys.unraisablehook, threading.excepthook = hooks
        sys.stderr.close()
        sys.stderr = previous
        os.dup2(terminal, 2)
        os.close(terminal)


def _to_native_log(path: Path, kind, value, tb, header) -> None:
    with contextlib.suppress(Exception):  # the disk may be full: then it is dropped
        with open(path, "a") as log:
            log.write(f"{header}\n{''.join(traceback.format_exception(kind, value, tb))}")


def _exit_after_write_failure() -> None:
    """Ends the process at once, its line said and the run's files closed: the libraries' threads
    left by the failed write (Orbax's and TensorStore's, tensorboardX flushing onto the full disk)
    can crash or hang the interpreter's teardown (measured: a SIGSEGV after the line in 1 of 12
    runs four at a time, and one 300 s hang in CI), as a multi-host job process also exits."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Overrides may also follow options (`compile CONFIG --topology v5e-8 train.remat=full`);
    `eval` and `export` take a run directory for their config (`_from_run_dir`)."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if args.command in ("eval", "export", "serve"):
        _from_run_dir(args, parser)
    return args


def _from_run_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """`eval RUN_DIR` / `export RUN_DIR`: a directory holding config.yaml gives the run's config,
    and is the checkpoint unless --checkpoint (or --hf) names another source. A config file
    (the older form) needs --checkpoint or --hf."""
    from jaxreplay import storage

    def refuse(why: str):
        parser.exit(2, error_line("usage error", f"{why} (see {parser.prog} {args.command} --help)") + "\n")

    given = args.config
    config_file = storage.join(given, "config.yaml")
    try:
        storage.check(given, args.command)
        is_dir = storage.isdir(given)
        is_run_dir = is_dir and storage.exists(config_file)
        if is_run_dir:
            args.config = str(storage.staged(config_file))  # a bucket's config.yaml is read from a local copy
    except Exception as e:  # a bucket that cannot be reached: one line, from _command
        raise _RunDirUnreadable(f"{args.command}: cannot read {given}: {e}" if _own(e) else
                                f"{args.command}: cannot read {given}: {type(e).__name__}: {e}") from None
    if is_run_dir:
        if args.checkpoint is None and getattr(args, "hf", None) is None:
            args.checkpoint = given
    elif is_dir:
        refuse(f"{args.command}: {given} is a directory without config.yaml, so not a run directory; give "
                     f"the run's directory, or a config file and --checkpoint RUN_DIR")
    elif args.checkpoint is None and getattr(args, "hf", None) is None:
        source = "one of the arguments --checkpoint --hf is" if args.command in ("eval", "serve") else \
            "the argument --checkpoint is"
        refuse(f"{source} required with a config file (or give a run directory holding config.yaml "
                     f"instead of {given})")


class _RunDirUnreadable(Exception):
    """The run directory given to eval or export could not be looked at (a bucket out of reach)."""

    kind = "error"


def main(argv: list[str] | None = None) -> int:
    """The command; `argv` None: this process is the command, and its stop signals stay
    flags until it exits (train, eval); given, they are put back on return (an in-process call)."""
    try:
        return _command(argv)
    finally:
        if argv is not None:
            guards.PreemptionNotice.release_process()


def fail(kind: str, why: str) -> None:
    """The command's last line, on stderr: `jaxreplay: <kind>: <why>`."""
    print(error_line(kind, why), file=sys.stderr, flush=True)


def _command(argv: list[str] | None) -> int:
    try:
        args = _parse(argv)
    except _RunDirUnreadable as e:
        fail(e.kind, str(e))
        return 2
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
        if args.command == "serve":
            return _serve(args, config)
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
            from jaxreplay.compat import describe_tier

            print(f"jaxreplay {_own_version()} on {describe_tier()}", flush=True)
            from jaxreplay.train.driver import train

            summary = train(config)
        if signum := guards.pending():  # after the run's last look at the flag: its final checkpoint is saved
            fail(guards.KIND[signum], f"{guards.describe(signum)} as the run ended: its final checkpoint is step "
                                      f"{summary['steps']} in {Path(config.run.dir) / 'checkpoints'}")
            return guards.EXIT_CODE[signum]
        return 0
    except KeyboardInterrupt:  # commands that leave Ctrl-C its default meaning
        fail("interrupted", guards.describe(signal.SIGINT))
        return guards.EXIT_CODE[signal.SIGINT]
    except guards.Preempted as e:  # a stop signal, after the final checkpoint where one was due
        fail(e.kind, str(e))
        return e.exit_code
    except Exception as e:  # one line for users; --debug for developers
        if args.debug:
            traceback.print_exc()
        if isinstance(e, ConfigError):
            if config is None and (sweep := _sweep_file(getattr(args, "config", None))):
                fail("config error", sweep)
            else:
                fail(*described(e))
            return 2
        if failure := _write_failure(e):  # disk full, read-only, quota: the path and the OS's word
            from jaxreplay.train.checkpoint import write_failure_message

            fail("error", write_failure_message(failure, config.run.dir if config is not None else None))
            if argv is None and not args.debug:  # a process of its own (the console script)
                _exit_after_write_failure()
            return 2
        fail(*described(e))
        return 2 if _bad_input(e) else 1


def _sweep_file(path) -> str:
    """Why `path`, given where a run's config goes, is not one: it is a sweep file ("" where not)."""
    from jaxreplay.research.sweep import is_sweep_file

    if not path or not is_sweep_file(path):
        return ""
    return (f"{path} is a sweep file (base, settings, seeds), not a run's config: `jaxreplay sweep {path} "
            "--print` prints the command of each of its runs")


def described(error: BaseException) -> tuple[str, str]:
    """(kind, why) of the line that reports `error`. An exception may name its kind (`kind`: a
    `ConfigError` is a config error, another run holding run.dir's lock an error). Errors this
    package raises carry messages written to be read alone; any other's type is named too."""
    own = _own(error)
    kind = getattr(error, "kind", None) if own else None
    return kind if kind in ERROR_KINDS else "error", str(error) if own and str(error) else \
        f"{type(error).__name__}: {error}"


def _own(error: BaseException) -> bool:
    """Whether this package raised `error` (its message and `kind` are written for users)."""
    return type(error).__module__.split(".")[0] == "jaxreplay"


def _serve(args: argparse.Namespace, config) -> int:
    """`jaxreplay serve`: the policy as `eval` loads it, behind the HTTP server (serve/)."""
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise _MissingExtra("serve: needs aiohttp: pip install 'jaxreplay[serve]'") from None
    from jaxreplay.models.hf import family_of
    from jaxreplay.serve.app import ServerSettings
    from jaxreplay.serve.protocol import Limits
    from jaxreplay.serve.run import bearer_token, make_worker, run_server
    from jaxreplay.serve.worker import Draw
    from jaxreplay.train.eval import load_policy

    bearer_token(args.host)  # refused before any loading: another address than loopback needs a token

    cfg, graphdef, params, tokenizer, source = load_policy(config, checkpoint=args.checkpoint, hf=args.hf,
                                                           step=args.step)
    if tokenizer is None:
        from jaxreplay.tasks.registry import make_task

        tokenizer = make_task(config.task).tokenizer
    s = config.sampling
    max_tokens = args.max_tokens or s.max_new_tokens
    prompt_len = args.max_prompt_len or cfg.max_seq_len - max_tokens
    slots = args.slots or s.engine_slots or 16
    worker = make_worker(graphdef, cfg, params, tokenizer, slots=slots, prompt_len=prompt_len, max_tokens=max_tokens,
                         chunk_steps=s.engine_chunk_steps, kv_cache_dtype=s.kv_cache_dtype,
                         prefill_chunk_size=s.prefill_chunk_size, max_engines=args.max_engines)
    name = args.model_name or str(args.hf or args.checkpoint)
    try:
        call_format = args.tool_call_format or ("llama3" if family_of(cfg) == "llama" else "qwen")
    except Exception:
        call_format = args.tool_call_format or "qwen"
    settings = ServerSettings(model_id=name, call_format=call_format, grace_s=args.grace_s)
    limits = Limits(prompt_len=prompt_len, max_tokens=max_tokens, max_n=args.max_n, vocab_size=tokenizer.vocab_size)
    print(f"jaxreplay {_own_version()}: serving {source}", flush=True)
    return run_server(worker, tokenizer, limits, settings, host=args.host, port=args.port,
                      warm_draw=Draw.of(s.temperature, s.top_k, s.top_p))


class _MissingExtra(Exception):
    kind = "error"


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
        fail("error", f"does not fit: {e}")
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
    Hugging Face model directory) or could change (a run dir another run holds, libtpu not
    installed: errors of this package with `kind = "error"`): exit code 2, like a config error."""
    from jaxreplay.models.errors import HFModelError
    from jaxreplay.tasks.datasets import DatasetError
    from jaxreplay.replay.backend import DamagedCheckpoint
    from jaxreplay.train.checkpoint import CheckpointError

    return isinstance(error, (CheckpointError, DamagedCheckpoint, DatasetError, HFModelError)) or \
        (_own(error) and getattr(error, "kind", None) == "error")


if __name__ == "__main__":
    sys.exit(main())
