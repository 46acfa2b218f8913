"""Prompt sources and verifiable rewards: the embedded arithmetic task, datasets, math rewards;
registry.py builds the task a config names."""


def __getattr__(name: str):
    """The names this package exported before the layout by stage, imported only when used (jaxreplay.moved_name)."""
    from jaxreplay import moved_name
    return moved_name(__name__, name)
