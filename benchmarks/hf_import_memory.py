"""Peak host memory of importing a sharded HF checkpoint, against its size on disk.

    .venv/bin/python benchmarks/hf_import_memory.py [--dir /tmp/hf_mem] [--devices 4]

Makes a random Qwen3-shaped checkpoint (~360 MB float32, four safetensors shards with an
index) with transformers in one subprocess, then imports it in fresh subprocesses and
reads each one's peak resident set (getrusage ru_maxrss):
  - `load_hf_model` onto one device;
  - `load_hf_model` onto a (fsdp, tensor) mesh of `--devices` CPU devices;
  - for contrast, the naive way: every shard read whole with safetensors, then device_put.
On CPU the "device" memory is host memory, so the imported parameters themselves count:
the floor is the baseline (interpreter + JAX) plus one checkpoint's worth.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
from pathlib import Path

MAKE = """
import sys, torch, transformers
config = transformers.Qwen3Config(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=64, tie_word_embeddings=False)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.save_pretrained(sys.argv[1], max_shard_size="100MB")
"""

MEASURE = """
import os, sys, json, resource
devices = int(sys.argv[3])
if devices > 1:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
import jax, numpy as np
from jaxreplay.models.transformer import abstract_params
from jaxreplay.models.hf import load_hf_model, read_model_config

def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

path, how = sys.argv[1], sys.argv[2]
read_model_config(path)  # imports transformers' config code, as the real import does
jax.device_put(np.zeros(1)).block_until_ready()  # backend up
base = rss_mb()
if how == "load_hf_model":
    shardings = None
    if devices > 1:
        from jax.sharding import Mesh
        from jaxreplay.models.sharding import param_shardings
        mesh = Mesh(np.array(jax.devices()).reshape(1, 2, devices // 2), ("data", "fsdp", "tensor"))
        shardings = param_shardings(mesh, abstract_params(read_model_config(path)))
    _, _, params = load_hf_model(path, shardings=shardings)
else:  # naive: whole files on the host, then to the device
    from safetensors.numpy import load_file
    host = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            host.update(load_file(os.path.join(path, f)))
    params = {k: jax.device_put(v.T if v.ndim == 2 else v) for k, v in host.items()}
jax.block_until_ready(params)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
print(json.dumps({"baseline_mb": round(base), "peak_mb": round(peak), "params_mb": round(nbytes / 2**20)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="/tmp/hf_import_memory")
    parser.add_argument("--devices", type=int, default=4)
    args = parser.parse_args()
    path = Path(args.dir)
    if not (path / "model.safetensors.index.json").is_file():
        subprocess.run([sys.executable, "-c", MAKE, str(path)], check=True, timeout=600)
    files = sorted(path.glob("*.safetensors"))
    disk_mb = sum(f.stat().st_size for f in files) / 2**20
    print(f"checkpoint: {path}, {len(files)} safetensors shards, {disk_mb:.0f} MiB on disk "
          f"(largest shard {max(f.stat().st_size for f in files) / 2**20:.0f} MiB, "
          f"largest tensor {_largest_tensor_bytes(files) / 2**20:.0f} MiB)")
    for how, devices in [("load_hf_model", 1), ("load_hf_model", args.devices), ("naive", 1)]:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(MEASURE), str(path), how, str(devices)],
                             check=True, capture_output=True, text=True, timeout=600).stdout
        r = json.loads(out.strip().splitlines()[-1])
        extra = r["peak_mb"] - r["baseline_mb"]
        print(f"{how:>14} on {devices} device(s): peak RSS {r['peak_mb']} MiB = baseline {r['baseline_mb']} MiB "
              f"+ {extra} MiB ({extra / disk_mb:.2f}x the checkpoint) = baseline + params {r['params_mb']} MiB "
              f"+ transient {extra - r['params_mb']} MiB")


def _largest_tensor_bytes(files: list[Path]) -> int:
    """From the safetensors headers: 8 bytes of header length, then JSON with data offsets."""
    largest = 0
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        largest = max([largest] + [end - begin for name, t in header.items() if name != "__metadata__"
                                   for begin, end in [t["data_offsets"]]])
    return largest


if __name__ == "__main__":
    main()
