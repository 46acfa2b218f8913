"""Tools around a run: TPU compiles on any host (aot, topology), HF export, XLA CPU flags."""
