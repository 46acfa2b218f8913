"""Experience replay behind one protocol (backend.py); only reverb_backend.py touches Reverb.

    tables = build_tables(config, item_spec)   # backend-neutral, with the backend's name
    with serve(tables, port=config.replay.port, checkpoint_root=...) as server:   # a Backend
        RolloutWriter(server, item_spec, timeout_s=t).insert(rollouts)
        batch, info = RolloutReader(server, timeout_s=t).sample(B)
        name = server.checkpoint()   # relative to checkpoint_root: pass as restore_from=

`replay.backend` picks the table server: "reverb" (a DeepMind Reverb server,
reverb_backend.py), "inprocess" (inprocess.py: the same semantics in this process, no
TensorFlow), or "auto" (Reverb where it is installed). Multi-host runs see either through
one global limiter view (multiprocess.py): in-process tables sharded over the processes,
or one Reverb server on process 0. Importing this package imports neither Reverb nor
TensorFlow; the Reverb backend imports them on first use, hiding accelerators from
TensorFlow first so it never takes GPU memory that JAX needs. Every blocking call ends
in `ReplayTimeoutError` after its timeout, waiting in short slices so that signal
handlers run; readers and writers given `interrupted` end their waits in
`ReplayInterrupted` once it returns true.
"""

from jaxreplay.replay.backend import Backend, Client, SampleInfo
from jaxreplay.replay.inprocess import InProcessServer
from jaxreplay.replay.ports import PortInUseError, check_port
from jaxreplay.replay.reader import IncrementalReader, PositiveBiasReader, RolloutReader, reader_for
from jaxreplay.replay.reverb_backend import ReverbClient, ReverbServer, set_tf_cpu_only
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import (
    POSITIVE_TABLE_NAME, TABLE_NAME, ItemSpec, LimiterState, PositiveSplit, RateLimit, ReplayInterrupted,
    ReplayTimeoutError, TableDef, Tables, TableSharedError, build_tables, check_only_client, positive_split,
    resolve_backend, table_defs)
from jaxreplay.replay.writer import RolloutWriter, writer_for


__all__ = [
    "POSITIVE_TABLE_NAME", "TABLE_NAME", "Backend", "Client", "InProcessServer", "IncrementalReader", "ItemSpec",
    "LimiterState", "PortInUseError", "PositiveBiasReader", "PositiveSplit", "RateLimit", "ReplayInterrupted",
    "ReplayTimeoutError", "ReverbClient", "ReverbServer", "RolloutReader", "RolloutWriter",
    "SampleInfo", "TableDef", "TableSharedError", "Tables", "build_tables", "check_only_client", "check_port",
    "positive_split", "reader_for", "resolve_backend", "serve", "set_tf_cpu_only", "table_defs", "writer_for",
]
