#!/usr/bin/env bash
# The accelerator benchmark on a machine whose Python already has a current JAX for its
# accelerator (a GPU image: jax >= 0.8 with CUDA, flax, optax, pyyaml; transformers and torch
# for the side-by-side reference), from the repository root, offline:
#   benchmarks/device.sh OUT_DIR [--quick]          (PYTHON=... picks the interpreter)
#   benchmarks/device.sh OUT_DIR --rollout [--quick]  the rollout engine's long-tail and shared-prompt
#     workloads on a 0.5B-shaped bf16 model (benchmarks/rollout.py): tokens/s, rollouts/s, and the
#     share of HBM bandwidth an engine decode step reaches; writes OUT_DIR/rollout.json
# It installs nothing and creates no venv: this checkout is imported from the working
# directory, the rest is what that Python has. Writes OUT_DIR/device.json in under 5 minutes
# (a time limit stops it at 290 s; device.json keeps what was measured by then).
set -euo pipefail
out=${1:?usage: benchmarks/device.sh OUT_DIR [--quick]}
shift
python=${PYTHON:-python3}
cd "$(dirname "$0")/.."
if ! missing=$("$python" -c 'import jax, flax, optax, yaml, numpy' 2>&1); then
  echo "device.sh: $python cannot run the benchmark (${missing##*$'\n'}); it installs nothing: set PYTHON to one with jax >= 0.8, flax, optax, pyyaml" >&2
  exit 2
fi
# JAX preallocates this share of accelerator memory; the rest is left to torch's reference.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.75}
module=benchmarks.device
json=device.json
args=()
for arg in "$@"; do
  if [ "$arg" = --rollout ]; then module=benchmarks.rollout; json=rollout.json; else args+=("$arg"); fi
done
status=0
timeout 290 "$python" -m "$module" --out "$out" ${args[@]+"${args[@]}"} || status=$?
if [ "$status" = 124 ]; then
  echo "device.sh: stopped at the 290 s limit; $out/$json has what was measured by then" >&2
fi
exit "$status"
