"""The research commands of `jaxreplay`: sweep, report, theory (parsers and handlers)."""

from __future__ import annotations

import argparse

DEMO_GROUP_SIZE = 8  # configs/demo.yaml's train.group_size: theory's default batch unit


def add_parsers(sub: argparse._SubParsersAction) -> None:
    sweep = sub.add_parser("sweep", help="run (or resume) a grid of settings x seeds, one after another")
    sweep.add_argument("sweep", help="sweep file, e.g. configs/sweep_demo.yaml")
    sweep.add_argument("overrides", nargs="*", help="dotted overrides for every run, e.g. train.steps=50")
    sweep.add_argument("--print", action="store_true", help="print one command per run instead of running")
    report = sub.add_parser("report", help="plots and a Markdown table comparing runs")
    report.add_argument("run_dirs", nargs="+", help="run directories (seeds of one setting share a parent folder)")
    report.add_argument("--out", required=True, help="directory for report.md and the PNGs")
    report.add_argument("--baseline", help="setting to compare against (default: the on-policy one)")
    report.add_argument("--mu", help="generation / training cost per rollout to model compute at, besides the "
                        "measured one, e.g. 5.28,6.84 (the paper's Qwen2.5-7B and Qwen3-0.6B)")
    report.add_argument("--sweep", help="the sweep file whose claims to decide (default: the claims.yaml its "
                        "sweep wrote beside the setting folders, if any)")
    theory = sub.add_parser("theory", help="optimal staleness horizon and replay ratio of the cost model")
    theory.add_argument("--mu", help="generation / training cost per rollout; several as in report: 5.28,6.84")
    theory.add_argument("--rho", type=float, help="batch-variance weight of the cost model")
    theory.add_argument("--alpha", type=float, help="staleness exponent: sigma(x) = (x/tau)^alpha")
    theory.add_argument("--fit-table", action="store_true", help="solve mu from the paper's Table 1 gammas "
                        "(needs no --mu, --rho or --alpha)")
    theory.add_argument("--config", help="a run config: its R (prompts_per_step x group_size), train.batch_size "
                        "and train.group_size stand in for the flags below")
    theory.add_argument("--rollouts-per-step", type=int, help="R: rollouts generated per actor step (default 64)")
    theory.add_argument("--batch-size", type=int, help="a config's train.batch_size B: also print the window that "
                        "realises x* at that B")
    theory.add_argument("--group-size", type=int, help="train.group_size: printed batch sizes keep groups whole "
                        f"(multiples of it; default {DEMO_GROUP_SIZE}, the demo's)")
    theory.add_argument("--data-parallelism", type=int, default=1, help="the mesh's data parallelism: printed batch "
                        "sizes are multiples of it")

def run(args: argparse.Namespace) -> int:
    if args.command == "sweep":
        from jaxreplay.research.sweep import commands, load_sweep, run_sweep

        sweep = load_sweep(args.sweep, args.overrides)
        if args.print:
            print("\n".join(commands(sweep)))
            return 0
        results = run_sweep(sweep)
        return 0 if all(r in ("done", "skipped") for r in results.values()) else 1
    if args.command == "report":
        from jaxreplay.research.report import report
        from jaxreplay.research.report_stats import parse_mus

        print(report(args.run_dirs, args.out, baseline=args.baseline, mus=parse_mus(args.mu), sweep=args.sweep),
              end="")
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
    from jaxreplay.research.report_stats import parse_mus

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
    mus = parse_mus(args.mu)
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
