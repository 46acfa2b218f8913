"""Experience replay through a DeepMind Reverb table: the only package that imports reverb.

    table = build_table(config, item_spec)
    with ReplayServer(table, port=config.replay.port, checkpoint_root=...) as server:
        RolloutWriter(server, item_spec, timeout_s=t).insert(rollouts)
        batch, info = RolloutReader(server, item_spec, timeout_s=t).sample(B)

Every blocking call ends in `ReplayTimeoutError` after its timeout. Importing this
package hides accelerators from TensorFlow (Reverb imports it), so TensorFlow never
takes GPU memory that JAX needs; it sets `TF_CPP_MIN_LOG_LEVEL=1` unless already set.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")

import tensorflow as tf  # noqa: E402


def set_tf_cpu_only() -> None:
    """Keeps TensorFlow off GPUs; a no-op once TensorFlow has initialized its devices."""
    try:
        tf.config.set_visible_devices([], "GPU")
    except RuntimeError:
        pass  # Devices already initialized: too late to hide them, and nothing to do here.


set_tf_cpu_only()

from jaxreplay.replay.reader import (  # noqa: E402
    IncrementalReader, PositiveBiasReader, RolloutReader, SampleInfo, reader_for)
from jaxreplay.replay.server import ReplayServer  # noqa: E402
from jaxreplay.replay.tables import (  # noqa: E402
    POSITIVE_TABLE_NAME, TABLE_NAME, ItemSpec, LimiterState, PositiveSplit, ReplayTimeoutError, build_table,
    build_tables, positive_split)
from jaxreplay.replay.writer import RolloutWriter, writer_for  # noqa: E402

__all__ = [
    "POSITIVE_TABLE_NAME", "TABLE_NAME", "IncrementalReader", "ItemSpec", "LimiterState", "PositiveBiasReader", "PositiveSplit",
    "ReplayServer", "ReplayTimeoutError", "RolloutReader", "RolloutWriter", "SampleInfo", "build_table",
    "build_tables", "positive_split", "reader_for", "set_tf_cpu_only", "writer_for",
]
