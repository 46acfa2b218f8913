"""The fit table of docs/benchmarks.md: `jaxreplay compile` on every real-model config, on the slice it names.

    python -m benchmarks.fit_table [--out DIR] [CONFIG ...]   # default: the pod and real-model configs

Each config compiles in its own process (one compile holds several GiB of host memory),
with a timeout; the JSON reports go to DIR and a Markdown table to stdout. Needs libtpu
(the `tpu` extra). On a 2-core host the 7B config takes about 16 minutes, Qwen3-30B-A3B 2 hours.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["pod_v4-8_qwen2.5_0.5b", "pod_v4-8_qwen2.5_1.5b", "pod_v5e-8_qwen2.5_0.5b", "pod_v5e-8_qwen2.5_1.5b",
           "pod_v5e-8_qwen2.5_0.5b_gsm8k", "pod_v5e-16_qwen2.5_0.5b_gsm8k",
           "qwen2.5_0.5b_instruct_gsm8k_colab", "qwen3_0.6b_math", "qwen2.5_7b_math",
           "qwen2.5_1.5b_instruct_gsm8k_colab_lora", "qwen2.5_3b_instruct_gsm8k_colab_lora",
           "pod_v5e-8_qwen2.5_7b_gsm8k_lora", "gemma3_1b_it_gsm8k_colab_lora", "pod_v5e-8_gemma3_4b_gsm8k",
           "pod_v6e-8_qwen3_30b_a3b_gsm8k_lora"]
GiB = 1 << 30


def row(name: str, report: dict) -> str:
    train = next(p for p in report["programs"] if p["name"] == "train step")
    samplers = [p for p in report["programs"] if p["name"] != "train step"]
    sampler = max(samplers, key=lambda p: p["total"])
    gib = lambda p: "over (compiler)" if p["oom"] else f"{p['total'] / GiB:.2f}"
    flops = "" if train["flops"] is None else f"{train['flops'] / 1e12:.3g}"
    compile_s = sum(p["compile_s"] for p in report["programs"])
    hbm = "-" if report["hbm"] is None else f"{report['hbm'] / GiB:.0f}"
    fits = {None: "-", True: "yes", False: "NO"}[report["fits"]]
    return (f"| `{name}` | {report['target']} ({report['n_devices']} x {report['device_kind']}) "
            f"| {report['mesh'].split(' (')[0]} | {gib(train)} | {gib(sampler)} ({sampler['name'].split(' (')[0]}) "
            f"| {hbm} | {fits} | {flops} | {compile_s:.0f} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", default=CONFIGS, help="config names under configs/ (no .yaml)")
    parser.add_argument("--out", default="runs/fit", help="directory for the JSON reports")
    parser.add_argument("--timeout", type=float, default=3 * 3600, help="seconds per config")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.configs:
        report = out / f"{name}.json"
        cmd = [sys.executable, "-m", "jaxreplay.cli", "compile", str(ROOT / "configs" / f"{name}.yaml"),
               "--json", str(report)]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
        if not report.is_file():
            print(f"{name}: jaxreplay compile failed (exit {done.returncode}): {done.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
            continue
        rows.append(row(name, json.loads(report.read_text())))
    print("| config | slice | mesh | train step GiB/device | sampler GiB/device | HBM GiB | fits | train TFLOP/device "
          "| compile s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
