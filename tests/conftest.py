"""What every test, and every process a test starts, shares: XLA's persistent compilation cache.

The suite compiles the same small programs many times over (the same tiny configs in many
tests, and in the `jaxreplay train` processes tests start); compiled once and loaded after,
test_train.py takes half the CPU time on 2 cores. Entries are keyed by the program, the
jax/jaxlib version, the backend and the flags, so lanes and runs share the folder safely.
Set JAX_COMPILATION_CACHE_DIR to use another folder.
"""

import os
from pathlib import Path

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # read by jax at import, and inherited by subprocesses
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(Path(__file__).resolve().parents[1] / ".jax-cache")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
