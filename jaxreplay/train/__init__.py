"""One training run: placement -> stack -> schedule (turns or concurrent roles), with its checkpoints,
records, run dir, evaluation and multi-process coordination. driver.train is the entry point."""
