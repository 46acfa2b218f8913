#!/usr/bin/env bash
# The accelerator benchmark on a fresh one-GPU machine (H200, H100) or a TPU VM, from the
# repository root:   benchmarks/device.sh OUT_DIR [gpu|tpu]
# Installs this package with the accelerator's jaxlib (and torch, the generate reference) into
# .venv-device, then runs benchmarks/device.py: OUT_DIR/device.json, in under 5 minutes.
set -euo pipefail
out=${1:?usage: benchmarks/device.sh OUT_DIR [gpu|tpu]}
kind=${2:-gpu}
case "$kind" in
  gpu) jax_extra="jax[cuda12]==0.4.34" ;;
  tpu) jax_extra="jax[tpu]==0.4.34 -f https://storage.googleapis.com/jax-releases/libtpu_releases.html" ;;
  *) echo "device.sh: kind must be gpu or tpu, got '$kind'" >&2; exit 2 ;;
esac
venv=.venv-device
test -x "$venv/bin/python" || python3.11 -m venv "$venv"
"$venv/bin/pip" install --quiet -e '.[test]' $jax_extra
# No TensorFlow on the accelerator: Reverb is not used here, and JAX keeps the memory.
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.85 TF_CPP_MIN_LOG_LEVEL=2
timeout 600 "$venv/bin/python" -m benchmarks.device --out "$out"
