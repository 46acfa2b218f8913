"""Experience replay behind one protocol (backend.py); only reverb_backend.py touches Reverb.

    tables = build_tables(config, item_spec)   # tables.py: backend-neutral, with the backend's name
    with serve(tables, port=config.replay.port, checkpoint_root=...) as server:   # server.py: a Backend
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

limiter.py holds the rate limiter's arithmetic (what a table admits, the next move of a turn, the
deadlock-window rule); theory.py the cost model that chooses a replay ratio and window.
"""


def __getattr__(name: str):
    """The names this package exported before the layout by stage, imported only when used (jaxreplay.moved_name)."""
    from jaxreplay import moved_name
    return moved_name(__name__, name)
