"""jaxreplay."""

# The modules that own config keys (tasks/, the scheduler, the multi-process replay, the TPU slice table,
# the shipped architectures) register their checks with `config.validate` on import
# (config.owner_check); importing them here puts every check in place before any config loads.
from jaxreplay import architectures as _architectures  # noqa: F401
from jaxreplay import scheduler as _scheduler  # noqa: F401
from jaxreplay import tasks as _tasks  # noqa: F401
from jaxreplay import topology as _topology  # noqa: F401
from jaxreplay.replay import multiprocess as _multiprocess  # noqa: F401
