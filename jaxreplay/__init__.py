"""jaxreplay: RL post-training of language models with experience replay.

The subpackages are the stages, lowest first (docs/architecture.md): models, tasks, replay,
rollout, learn, train, research, tools; config and compat sit below them all, cli above.
Importing the package imports nothing else.

Modules that lived at the package root before the layout by stage still import under their old
names for one release, with a DeprecationWarning (`jaxreplay.driver` is `jaxreplay.train.driver`),
and so do the names the stage packages exported then (`from jaxreplay.models import forward` is
`jaxreplay.models.transformer.forward`): the packages' `__getattr__` imports them on first use, so
importing a package still imports nothing. docs/reference/api.md lists the supported paths.
"""

import contextlib
import importlib
import importlib.abc
import importlib.util
import sys
import warnings

# The words a failed or stopped command's one stderr line may start with, after `jaxreplay: `.
# Outside scripts parse them: config error (the config or an override), usage error (the command
# line), error (anything else; with exit status 2 where the input is at fault), stopped (SIGTERM)
# and interrupted (SIGINT, Ctrl-C).
ERROR_KINDS = ("config error", "usage error", "error", "stopped", "interrupted")
MAX_MESSAGE = 1000  # characters of an error line: messages may quote user input


def error_line(kind: str, why: str) -> str:
    """`jaxreplay: <kind>: <why>`, one line of at most MAX_MESSAGE characters: the one format every
    command's failure or stop is reported in (the CLI, the signal guards, each process of a job)."""
    if kind not in ERROR_KINDS:
        raise ValueError(f"not an error kind: {kind!r} (one of {', '.join(ERROR_KINDS)})")
    line = f"jaxreplay: {kind}: {' '.join(str(why).split())}"
    return line if len(line) <= MAX_MESSAGE else f"{line[:MAX_MESSAGE - 3]}..."


def warn(text: str) -> None:
    """`warning: <text>`, one line on stderr, as errors are, so `jaxreplay ... > log` still shows it
    (stdout is progress). A progress bar, on stderr too, is cleared first and drawn again below it."""
    bars = sys.modules.get("tqdm")
    with bars.tqdm.external_write_mode(file=sys.stderr) if bars is not None else contextlib.nullcontext():
        print(f"warning: {' '.join(str(text).split())}", file=sys.stderr, flush=True)


_MOVED = {
    **{f"jaxreplay.{m}": f"jaxreplay.train.{m}" for m in (
        "accounting", "calibrate", "checkpoint", "distributed", "driver", "eval", "guards", "metrics",
        "placement", "recorder", "roles", "run", "rundir", "stack", "turns", "warmstart")},
    **{f"jaxreplay.{m}": f"jaxreplay.rollout.{m}" for m in ("actor", "rollouts", "sampling")},
    **{f"jaxreplay.{m}": f"jaxreplay.learn.{m}" for m in ("learner", "scoring")},
    **{f"jaxreplay.{m}": f"jaxreplay.research.{m}" for m in (
        "commands", "report", "report_data", "report_plots", "report_stats", "sweep")},
    **{f"jaxreplay.{m}": f"jaxreplay.tools.{m}" for m in ("aot", "export", "topology", "xla_cpu")},
    "jaxreplay.rl.losses": "jaxreplay.learn.losses",
    "jaxreplay.rl.advantages": "jaxreplay.rollout.advantages",
    "jaxreplay.scheduler": "jaxreplay.replay.limiter",
    "jaxreplay.theory": "jaxreplay.replay.theory",
    "jaxreplay.sharding": "jaxreplay.models.sharding",
    "jaxreplay.architectures": "jaxreplay.models.architectures",
}


def _names(module: str, *names: str) -> dict[str, str]:
    return {name: module for name in names}


# The names each package exported before the layout by stage (ae959cf), and the modules they live in now
_MOVED_NAMES = {
    "jaxreplay.models": _names(
        "jaxreplay.models.transformer", "KV_CACHE_AXES", "KVCache", "REMAT_POLICIES", "Transformer", "abstract_model",
        "abstract_params", "apply", "count_params", "dtype_of", "forward", "init_cache", "init_params",
        "positions_from_mask", "score_hidden", "split"),
    "jaxreplay.replay": {
        **_names("jaxreplay.replay.tables", "POSITIVE_TABLE_NAME", "TABLE_NAME", "PositiveSplit", "RateLimit",
                 "ReplayInterrupted", "ReplayTimeoutError", "TableDef", "TableSharedError", "Tables", "build_tables",
                 "check_only_client", "positive_split", "resolve_backend", "table_defs"),
        **_names("jaxreplay.replay.backend", "Backend", "Client", "SampleInfo"),
        **_names("jaxreplay.replay.inprocess", "InProcessServer"),
        **_names("jaxreplay.replay.reader", "IncrementalReader", "PositiveBiasReader", "RolloutReader", "reader_for"),
        **_names("jaxreplay.replay.writer", "RolloutWriter", "writer_for"),
        **_names("jaxreplay.replay.rows", "ItemSpec"),
        **_names("jaxreplay.replay.limiter", "LimiterState"),
        **_names("jaxreplay.replay.ports", "PortInUseError", "check_port"),
        **_names("jaxreplay.replay.reverb_backend", "ReverbClient", "ReverbServer"),
        **_names("jaxreplay.replay.server", "serve"),
        **_names("jaxreplay.compat", "set_tf_cpu_only"),
    },
    "jaxreplay.tasks": {
        **_names("jaxreplay.tasks.arithmetic", "ArithmeticTask", "CharTokenizer", "Problem"),
        **_names("jaxreplay.tasks.base", "ByteTokenizer", "Task", "Tokenizer", "score"),
        **_names("jaxreplay.tasks.datasets", "DatasetError", "DatasetTask"),
        **_names("jaxreplay.tasks.registry", "make_task", "prompt_len", "validate_task"),
    },
    "jaxreplay.rl": {
        **_names("jaxreplay.learn.losses", "AGGREGATIONS", "LOSSES", "asymre_loss", "grpo_clip_loss", "kl_penalty",
                 "make_aggregate", "make_loss", "make_weights", "masked_mean", "token_mean_weights",
                 "truncated_is_loss", "weighted"),
        **_names("jaxreplay.rollout.advantages", "ADVANTAGES", "group_centered", "group_normalized", "leave_one_out"),
    },
}


def moved_name(package: str, name: str):
    """A stage package's module `__getattr__`: a name it exported before the layout by stage, taken
    from the module it lives in now (imported on this first use), with a DeprecationWarning
    naming the new path (once a process: the package keeps it). Any other name is an
    AttributeError, so `from package import submodule` still imports the submodule."""
    module = _MOVED_NAMES.get(package, {}).get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(f"{package}.{name} moved to {module}.{name}: import it from there", DeprecationWarning,
                  stacklevel=3)
    value = getattr(importlib.import_module(module), name)
    setattr(sys.modules[package], name, value)  # once: `from package import name` looks it up twice
    return value


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old module name as the module it moved to (the same module object)."""

    def find_spec(self, name, path=None, target=None):
        if name in _MOVED:
            return importlib.util.spec_from_loader(name, self)
        if name == "jaxreplay.rl":  # only a package of the two moved modules above
            return importlib.util.spec_from_loader(name, self, is_package=True)
        return None

    def create_module(self, spec):
        if spec.name == "jaxreplay.rl":
            return None
        warnings.warn(f"{spec.name} moved to {_MOVED[spec.name]}", DeprecationWarning, stacklevel=2)
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module):
        if module.__name__ == "jaxreplay.rl":
            module.__getattr__ = lambda name: moved_name("jaxreplay.rl", name)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
