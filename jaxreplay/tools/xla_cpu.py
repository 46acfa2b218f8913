"""XLA CPU compiler flags the entry points (CLI, benchmarks) set before JAX starts.

XLA reads `XLA_FLAGS` once, when the first computation creates its backends, so these
must be in the environment before then; a library import never changes them.
"""

from __future__ import annotations

import os
from typing import MutableMapping

# LLVM's default of 256-bit vectors avoids the clock penalty of early AVX-512 Intel parts.
# On AVX-512 machines without one (AMD Zen 4, Intel Ice Lake and later) 512-bit vectors
# speed up the decode loop's elementwise work: 1.2-1.3x tokens/s at batch 16 and 64 on
# this project's 2-core CI machine (benchmarks/sampler.py). CPUs without AVX-512 ignore it.
CPU_FLAGS = {"--xla_cpu_prefer_vector_width": "512"}


def tune_cpu_compiler(environ: MutableMapping[str, str] = os.environ) -> str:
    """Adds each of `CPU_FLAGS` to `XLA_FLAGS` unless it is already set there (the user's
    setting wins); returns the resulting `XLA_FLAGS`."""
    flags = environ.get("XLA_FLAGS", "").split()
    named = {f.split("=", 1)[0] for f in flags}
    flags += [f"{name}={value}" for name, value in CPU_FLAGS.items() if name not in named]
    environ["XLA_FLAGS"] = " ".join(flags)
    return environ["XLA_FLAGS"]
