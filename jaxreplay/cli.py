"""`jaxreplay` command line: train (and resume) from a YAML config plus dotted overrides."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from pathlib import Path

from jaxreplay import commands as research


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxreplay", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show full tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train, or resume the run in run.dir")
    train.add_argument("config", help="YAML config, e.g. configs/demo.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. replay.samples_per_insert=4")
    show = sub.add_parser("config", help="print the resolved config without running")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*")
    research.add_parsers(sub)
    return parser


@contextlib.contextmanager
def _native_logs_to(path: Path):
    """Sends what C++ libraries (Reverb, TensorFlow, XLA) write to file descriptor 2 into
    `path`, keeping Python's own stderr (progress bar, errors) on the terminal."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    terminal = os.dup(2)
    with open(path, "a") as log:
        os.dup2(log.fileno(), 2)
    previous, sys.stderr = sys.stderr, os.fdopen(os.dup(terminal), "w", buffering=1)
    try:
        yield
    finally:
        sys.stderr.close()
        sys.stderr = previous
        os.dup2(terminal, 2)
        os.close(terminal)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow (under Reverb) is chatty on import
    from jaxreplay.config import ConfigError, load_config

    try:
        if args.command in research.COMMANDS:
            return research.run(args)
        config = load_config(args.config, args.overrides)
        if args.command == "config":
            import yaml

            from jaxreplay.config import to_dict

            print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
            return 0
        with _native_logs_to(Path(config.run.dir) / "native.log"):
            from jaxreplay.loop import train

            train(config)
        return 0
    except ConfigError as e:
        if args.debug:
            traceback.print_exc()
        print(f"jaxreplay: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jaxreplay: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # one line for users; --debug for developers
        if args.debug:
            traceback.print_exc()
        print(f"jaxreplay: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
