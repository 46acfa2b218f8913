"""jaxreplay."""

# The modules that own config keys register their checks with `config.validate` on import
# (config.owner_check); importing them here puts every check in place before any config loads.
from jaxreplay import tasks as _tasks  # noqa: F401
