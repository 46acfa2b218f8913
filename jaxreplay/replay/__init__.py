"""Experience replay: the only package that imports reverb.

    tables = build_tables(config, item_spec)   # Reverb's, or the in-process backend's
    with serve(tables, port=config.replay.port, checkpoint_root=...) as server:
        RolloutWriter(server, item_spec, timeout_s=t).insert(rollouts)
        batch, info = RolloutReader(server, item_spec, timeout_s=t).sample(B)

`replay.backend` picks the table server: "reverb" (a DeepMind Reverb server),
"inprocess" (inprocess.py: the same semantics in this process, no TensorFlow), or
"auto" (Reverb where it is installed). Multi-host runs see either through one global
limiter view (multiprocess.py): in-process tables sharded over the processes, or one
Reverb server on process 0. Importing this package
imports neither Reverb nor TensorFlow; the Reverb backend imports them on first use,
hiding accelerators from TensorFlow first so it never takes GPU memory that JAX needs.
Every blocking call ends in `ReplayTimeoutError` after its timeout, waiting in short
slices so that signal handlers run; readers and writers given `interrupted` end their
waits in `ReplayInterrupted` once it returns true.
"""

from jaxreplay.replay.inprocess import InProcessServer, InProcessTable
from jaxreplay.replay.reader import (
    IncrementalReader, PositiveBiasReader, RolloutReader, SampleInfo, reader_for)
from jaxreplay.replay.server import PortInUseError, ReplayServer, check_port, serve
from jaxreplay.replay.tables import (
    POSITIVE_TABLE_NAME, TABLE_NAME, ItemSpec, LimiterState, PositiveSplit, RateLimit, ReplayInterrupted,
    ReplayTimeoutError, TableDef, TableSharedError, build_table, build_tables, check_only_client, positive_split,
    resolve_backend, set_tf_cpu_only, table_defs)
from jaxreplay.replay.writer import RolloutWriter, writer_for

__all__ = [
    "POSITIVE_TABLE_NAME", "TABLE_NAME", "InProcessServer", "InProcessTable", "IncrementalReader", "ItemSpec",
    "LimiterState", "PortInUseError", "PositiveBiasReader", "PositiveSplit", "RateLimit", "ReplayInterrupted",
    "ReplayServer", "ReplayTimeoutError", "RolloutReader", "RolloutWriter", "SampleInfo", "TableDef",
    "TableSharedError", "build_table", "build_tables", "check_only_client", "check_port", "positive_split",
    "reader_for", "resolve_backend", "serve", "set_tf_cpu_only", "table_defs", "writer_for",
]
