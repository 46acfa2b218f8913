"""The entry points' XLA CPU flags: added unless the user set them, known to this jaxlib,
and set before JAX starts (importing the entry points starts nothing)."""

import os
import subprocess
import sys

import pytest

from jaxreplay.tools.xla_cpu import CPU_FLAGS, tune_cpu_compiler

pytestmark = pytest.mark.tier


def test_adds_each_flag_once_and_keeps_the_users():
    env = {}
    flags = tune_cpu_compiler(env)
    assert flags.split() == [f"{k}={v}" for k, v in CPU_FLAGS.items()]
    assert tune_cpu_compiler(env) == flags  # idempotent

    name = next(iter(CPU_FLAGS))
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count=2 {name}=256"}
    assert tune_cpu_compiler(env).split() == ["--xla_force_host_platform_device_count=2", f"{name}=256"]


def test_this_jaxlib_accepts_the_flags():
    """XLA aborts the process on a flag it does not know: a jaxlib upgrade must not break the CLI."""
    env = dict(os.environ)
    tune_cpu_compiler(env)
    out = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.arange(4.0).sum()))"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "6.0"


def test_importing_the_entry_points_starts_no_backend():
    """Otherwise the flags they set in main() would come too late."""
    code = ("import jaxreplay.cli, benchmarks.run\n"
            "from jax._src import xla_bridge\n"
            "print(xla_bridge.backends_are_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
