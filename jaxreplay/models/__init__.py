"""The policy model: a Llama/Qwen2/Qwen3-family decoder (transformer.py), Hugging Face checkpoints
in and out (hf.py, tokenizer.py), the shipped architectures, and the sharding rules (sharding.py).
"""


def __getattr__(name: str):
    """The names this package exported before the layout by stage, imported only when used (jaxreplay.moved_name)."""
    from jaxreplay import moved_name
    return moved_name(__name__, name)
