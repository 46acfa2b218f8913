"""The research commands of `jaxreplay`: sweep, report, theory (parsers and handlers)."""

from __future__ import annotations

import argparse
from typing import Callable

DEMO_GROUP_SIZE = 8  # configs/demo.yaml's train.group_size: theory's default batch unit


def add_parsers(sub: argparse._SubParsersAction, command_parser: Callable[..., argparse.ArgumentParser],
                overrides_help: str) -> None:
    """The research commands' parsers, made by the CLI's `command_parser` (a summary, a
    description and examples each)."""
    sweep = command_parser(
        sub, "sweep", "run (or resume) a grid of settings x seeds, one after another",
        "A sweep file names a base config, settings (lists of overrides) and seeds; each run gets its own\n"
        "run dir under the sweep's out folder. Finished runs are skipped, so the same command resumes.",
        "  jaxreplay sweep configs/sweep_demo.yaml\n"
        "  jaxreplay sweep configs/sweep_demo.yaml train.steps=50 --print    # the commands, not run\n"
        "  taskset -c 0 jaxreplay sweep configs/sweep_testbed.yaml --seeds 0,2,4 &    # one core each\n"
        "  taskset -c 1 jaxreplay sweep configs/sweep_testbed.yaml --seeds 1,3\n"
        "  jaxreplay sweep configs/sweep_mul_stage2.yaml --replicate 231,247 --out runs/mul_stage2_rep   # new seeds\n"
        "  jaxreplay sweep configs/sweep_pool_stage2.yaml --replicate 231 --out runs/pool_rep "
        "--settings on_policy_p128,spi4_nr16_p128 --print   # two arms")
    sweep.add_argument("sweep", help="the sweep file, e.g. configs/sweep_demo.yaml")
    sweep.add_argument("overrides", nargs="*", help=f"{overrides_help}; for every run")
    sweep.add_argument("--print", action="store_true", help="print one command per run instead of running")
    sweep.add_argument("--seeds", type=_seed_list, metavar="S,S,...",
                       help="run only these of the file's seeds, e.g. to split a sweep over cores or machines")
    sweep.add_argument("--settings", type=_name_list, metavar="NAME,NAME,...",
                       help="run only these of the file's settings: names or shell patterns like '*_p128' (quoted); "
                            "with --print, --seeds and --replicate alike")
    sweep.add_argument("--replicate", type=_seed_list, metavar="S,S,...",
                       help="replicate the sweep on these new seeds (none of the study's or its pilots'): the same "
                            "settings, rates and budgets, into --out")
    sweep.add_argument("--out", metavar="DIR", help="with --replicate: the replication's folder, apart from the "
                       "study's own (its report: jaxreplay report ... --replication DIR/*/seed*)")
    report = command_parser(
        sub, "report", "plots and a Markdown table comparing runs",
        "Reads each run dir's metrics and summary; seeds of one setting share a parent folder. Writes\n"
        "report.md and PNGs into --out, and prints the table.",
        "  jaxreplay report runs/sweep_demo/*/seed* --out runs/sweep_demo/report\n"
        "  jaxreplay report runs/sweep_demo/*/seed* --out runs/sweep_demo/report --mu 5.28,6.84 --baseline spi2\n"
        "  jaxreplay report runs/stage1/*/seed* --out results/stage1        # stage 1: writes selected.yaml\n"
        "  jaxreplay report runs/stage2/*/seed* --out results/stage2 --mu 5.28 --stage1 runs/stage1/*/seed*\n"
        "  jaxreplay report runs/stage2/*/seed* --out results/stage2_rep --mu 5.28 --replication runs/rep/*/seed*")
    report.add_argument("run_dirs", nargs="+", metavar="run_dir",
                        help="run directories (seeds of one setting share a parent folder)")
    report.add_argument("--out", required=True, metavar="DIR", help="directory for report.md and the PNGs (required)")
    report.add_argument("--baseline", metavar="SETTING[,SETTING]",
                        help="setting to compare against (default: the on-policy one); several split the settings "
                             "into pools, each paired with the baseline whose config it shares where they differ")
    add_mu_argument(report, "generation / training cost per rollout to model compute at, besides the measured one")
    report.add_argument("--sweep", metavar="FILE", help="the sweep file whose claims to decide, or whose `select` rule "
                        "picks each arm's learning rate in stage 1 (default: the claims.yaml or select.yaml its sweep "
                        "wrote beside the setting folders, if any)")
    report.add_argument("--stage1", nargs="+", default=[], metavar="RUN_DIR",
                        help="stage 2: the stage-1 run dirs (every arm at every learning rate), for the frontier at "
                             "the first --mu and the stage-1 table; copied into OUT/stage1")
    report.add_argument("--replication", nargs="+", default=[], metavar="RUN_DIR",
                        help="a replication's run dirs (jaxreplay sweep FILE --replicate S,S --out DIR): set "
                             "beside the declared seeds, its claims decided again on it alone, never pooled; copied "
                             "into OUT/replication")
    theory = command_parser(
        sub, "theory", "optimal staleness horizon and replay ratio of the cost model",
        "The paper's Theorem 4.5: x* = N/R and y* = B/R from the cost ratio mu, the batch-variance weight\n"
        "rho and the staleness exponent alpha, as train.batch_size and replay.max_size settings.",
        "  jaxreplay theory --mu 5.28 --rho 0.1 --alpha 0.1 --rollouts-per-step 64\n"
        "  jaxreplay theory --mu 5.28,6.84 --rho 0.1 --alpha 0.1 --config configs/demo.yaml\n"
        "  jaxreplay theory --fit-table                      # the mu behind the paper's Table 1")
    add_mu_argument(theory, "generation / training cost per rollout")
    theory.add_argument("--rho", type=float, help="batch-variance weight of the cost model (needed with --mu)")
    theory.add_argument("--alpha", type=float, help="staleness exponent: sigma(x) = (x/tau)^alpha (needed with --mu)")
    theory.add_argument("--fit-table", action="store_true", help="solve mu from the paper's Table 1 gammas "
                        "(needs no --mu, --rho or --alpha)")
    theory.add_argument("--config", help="a run config: its R (prompts_per_step x group_size), train.batch_size "
                        "and train.group_size stand in for the flags below")
    theory.add_argument("--rollouts-per-step", type=int, metavar="R",
                        help="R: rollouts generated per actor step (default: 64, or the config's)")
    theory.add_argument("--batch-size", type=int, metavar="B", help="a config's train.batch_size B: also print the "
                        "window that realises x* at that B")
    theory.add_argument("--group-size", type=int, metavar="G", help="train.group_size: printed batch sizes keep "
                        f"groups whole (multiples of it; default: {DEMO_GROUP_SIZE}, the demo's, or the config's)")
    theory.add_argument("--data-parallelism", type=int, default=1, metavar="D",
                        help="the mesh's data parallelism: printed batch sizes are multiples of it")


def add_mu_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """`--mu`, the same in every command: one number or several, comma-separated or repeated."""
    parser.add_argument("--mu", type=mu_list, action="extend", metavar="MU[,MU...]",
                        help=f"{what}: one number or several, e.g. 5.28 or 5.28,6.84 (the paper's Qwen2.5-7B and "
                             "Qwen3-0.6B); repeatable")


def mu_list(text: str) -> list[float]:
    """`--mu`'s value: `parse_mus`, with a bad value as a usage error."""
    from jaxreplay.config import ConfigError
    from jaxreplay.research.report_stats import parse_mus

    try:
        return list(parse_mus(text))
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--mu: ").removeprefix("--mu ")) from None


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected names separated by commas, like on_policy,spi4, got {text!r}")
    return names


def _seed_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, like 0,2,4, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    if args.command == "sweep":
        from jaxreplay.research.sweep import commands, load_sweep, run_sweep

        sweep = load_sweep(args.sweep, args.overrides, only_seeds=args.seeds, replicate=args.replicate,
                           replicate_out=args.out, only_settings=args.settings)
        if args.print:
            import os
            import sys

            print(f"# runs go under {os.path.abspath(sweep.out)}" + (" (a replication)" if sweep.replication else ""),
                  file=sys.stderr)
            print("\n".join(commands(sweep)))
            return 0
        results = run_sweep(sweep)
        return 0 if all(r in ("done", "skipped") for r in results.values()) else 1
    if args.command == "report":
        from jaxreplay.research.report import report

        print(report(args.run_dirs, args.out, baseline=args.baseline, mus=tuple(args.mu or ()), sweep=args.sweep,
                     stage1=args.stage1, replication=args.replication), end="")
        print(f"report: {args.out}/report.md")
        return 0
    if args.command == "theory":
        return _theory(args)
    raise AssertionError(f"not a research command: {args.command}")


COMMANDS = ("sweep", "report", "theory")


def _theory(args: argparse.Namespace) -> int:
    import math

    from jaxreplay.config import ConfigError, load_config
    from jaxreplay.replay.theory import describe, describe_fit, fit_table, numeric_optimum, optimum, split_table
    for flag in ("rollouts_per_step", "batch_size", "group_size", "data_parallelism"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    if args.config is not None:
        train = load_config(args.config).train
        args.rollouts_per_step = args.rollouts_per_step or train.prompts_per_step * train.group_size
        args.batch_size = args.batch_size or train.batch_size
        args.group_size = args.group_size or train.group_size
    rollouts, group = args.rollouts_per_step or 64, args.group_size or DEMO_GROUP_SIZE
    mus = tuple(args.mu or ())
    if args.fit_table:
        fit = fit_table()
        print(describe_fit(fit))
        print(split_table(round(fit.mu, 2)))
        if not (mus and args.rho is not None and args.alpha is not None):
            return 0
        print()
    missing = [f"--{k}" for k, v in (("mu", mus), ("rho", args.rho), ("alpha", args.alpha)) if v in ((), None)]
    if missing:
        raise ConfigError(f"theory: {' and '.join(missing)} required (or --fit-table)")
    unit = math.lcm(group, args.data_parallelism)
    for i, mu in enumerate(mus):
        try:
            opt = optimum(mu, args.rho, args.alpha)
        except ValueError as e:
            raise ConfigError(f"--{e}") from None
        check = numeric_optimum(mu, args.rho, args.alpha)
        print(("\n" if i else "") + describe(opt, rollouts, args.batch_size, unit))
        print(f"numeric minimiser of the cost: x = {check.x:.2f}, y = {check.y:.3f}")
    return 0
