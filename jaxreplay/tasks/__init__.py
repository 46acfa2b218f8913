"""Prompt sources and verifiable rewards: the embedded arithmetic task, datasets, math rewards;
registry.py builds the task a config names."""
