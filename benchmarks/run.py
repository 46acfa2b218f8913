"""All CPU benchmarks in one process, side by side: prints a table of ratios, writes JSON.

    .venv/bin/python -m benchmarks.run [rollout | rollout-chunks | replay-sidecar | replay-remote] [--quick] [--out results.json]
        [--torch-python PATH]

`rollout` runs only the rollout-engine benchmark (benchmarks/rollout.py): one line a workload;
`rollout-chunks` the engine's demo-long and full-batch at several chunk lengths, side by side;
`replay-sidecar` Reverb through its sidecar beside Reverb in process and the in-process backend
(benchmarks/replay_sidecar.py).
`replay-remote` a multi-host job's central Reverb table reached through sidecars, against the
Reverb lane's clients (benchmarks/replay_remote.py).

`--quick` shrinks every benchmark to seconds (tests/test_benchmarks.py runs it so it cannot
rot); its figures mean nothing. The full run takes a few minutes on 2 CPU cores. Absolute
throughput depends on what else runs on the machine, so the load average is recorded and
every comparison is a ratio of two measurements taken in this run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import time

from benchmarks import learner, replay, replay_remote, replay_sidecar, rollout, sampler, scaling
from jaxreplay.tools.xla_cpu import tune_cpu_compiler

TARGETS = {"sampler_ratio_b16_b64": 2.0, "replay_share_of_loop": 0.02}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="?", choices=["rollout", "rollout-chunks", "replay-sidecar", "replay-remote"],
                        help="run only this benchmark")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the code runs, measures nothing")
    parser.add_argument("--out", help="write the results here as JSON")
    parser.add_argument("--torch-python", help="interpreter with torch + transformers for the generate reference "
                        "(default: this one if it has torch, else .venv-reverb/bin/python)")
    args = parser.parse_args(argv)
    tune_cpu_compiler()  # as the CLI does, before the first JAX computation

    start = time.perf_counter()
    results = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                           "loadavg_start": os.getloadavg()}, "quick": args.quick}
    if args.only:
        results[args.only] = {"rollout": rollout.run, "rollout-chunks": rollout.chunk_lengths,
                              "replay-sidecar": replay_sidecar.run, "replay-remote": replay_remote.run}[args.only](args.quick)
        if args.only in ("replay-sidecar", "replay-remote"):
            lines = (replay_sidecar if args.only == "replay-sidecar" else replay_remote).lines
            print("\n".join(lines(results[args.only])), flush=True)
        results["machine"]["loadavg_end"] = os.getloadavg()
        results["seconds"] = time.perf_counter() - start
        print(f"[{args.only}: {results['seconds']:.0f}s, load average {results['machine']['loadavg_start'][0]:.1f} | "
              f"{results['machine']['loadavg_end'][0]:.1f} on {os.cpu_count()} cpus]", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
        return results
    for name, fn in [("sampler", functools.partial(sampler.run, torch_python=args.torch_python)),
                     ("learner", learner.run), ("replay", replay.throughput), ("demo", replay.demo_share),
                     ("scaling", scaling.run)]:
        t0 = time.perf_counter()
        results[name] = fn(quick=args.quick)
        print(f"[{name}: {time.perf_counter() - t0:.0f}s]", flush=True)
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["seconds"] = time.perf_counter() - start
    print(table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return results


def table(r: dict) -> str:
    """The human summary: one line per figure, target alongside where the issue sets one."""
    lines = [f"{'benchmark':<44}{'value':>14}  target"]
    row = lambda name, value, target="": lines.append(f"{name:<44}{value:>14}  {target}")
    for s in r["sampler"]:
        row(f"sampler/generate tok/s, batch {s['batch']}", f"{s['ratio']:.2f}x", ">= 2x" if s["batch"] >= 16 else "")
        row(f"  ours | generate tok/s (torch {s['torch']}, py {s['torch_python']}, {s['torch_threads']} thr)",
            f"{s['ours_tok_s']:.0f} | {s['generate_tok_s']:.0f}")
        row("  our compile s", f"{s['compile_s']:.1f}")
    ln = r["learner"]
    row("learner tokens/s (demo model)", f"{ln['tokens_s']:.0f}")
    row("learner step share outside the update", f"{100 * ln['outside_share']:.1f}%")
    rp = r["replay"]
    row("replay insert items/s (512 tokens)", f"{rp['insert_items_s']:.0f}")
    row("replay sample items/s (512 tokens)", f"{rp['sample_items_s']:.0f}")
    d = r["demo"]
    row(f"demo loop share in replay calls ({d['steps']} steps)", f"{100 * d['replay_share_of_loop']:.1f}%", "<= 2%")
    row("  replay | loop ms per learner step", f"{d['replay_ms_per_step']:.2f} | {d['loop_ms_per_step']:.1f}")
    sc = r["scaling"]
    for s in sc["rows"]:
        row(f"learner step ms, N = {s['items']}", f"{s['step_ms']:.1f}")
    row(f"step time N={sc['rows'][-1]['items']} / N={sc['rows'][0]['items']}", f"{sc['flatness']:.2f}x", "~1 (flat)")
    row(f"RSS growth over the last {sc['rss_growth_steps']} steps at full table", f"{sc['rss_growth_mib']:.1f} MiB",
        "~0")
    m = r["machine"]
    row("load average start | end", f"{m['loadavg_start'][0]:.1f} | {m['loadavg_end'][0]:.1f}",
        f"({m['cpus']} cpus)")
    row("total seconds", f"{r['seconds']:.0f}", "< 600")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
