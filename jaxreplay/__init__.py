"""jaxreplay: RL post-training of language models with experience replay.

The subpackages are the stages, lowest first (docs/architecture.md): models, tasks, replay,
rollout, learn, train, research, tools; config and compat sit below them all, cli above.
Importing the package imports nothing else.

Modules that lived at the package root before the layout by stage still import under their old
names for one release, with a DeprecationWarning (`jaxreplay.driver` is `jaxreplay.train.driver`).
"""

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
        pass


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())
