"""The model-file error both the HF bridge and the tokenizer raise, in the room below both."""


class HFModelError(ValueError):
    """A model directory this bridge cannot read or write; the one-line message names the file, key or tensor."""
