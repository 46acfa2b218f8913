"""Chat formats: how an episode's messages become token ids around the model's own turns.

Token in, token out: the model's sampled ids go into the episode as they were drawn; a format only
renders the environment's messages and the start of the model's next turn, appended after them.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from jaxreplay.tasks.environment import Message


class ChatFormat(Protocol):
    turn_end_ids: tuple[int, ...]  # ids that end a model turn (the engine's stop ids for a turn)

    def first_ids(self, messages: Sequence[Message]) -> list[int]:
        """The episode's prompt ids, ending where the model's first turn starts."""
        ...

    def next_ids(self, messages: Sequence[Message]) -> list[int]:
        """Ids appended after the model's own ids of its turn (which end in a turn_end id or were
        cut by a limit): the new messages, then the start of the model's next turn."""
        ...


class PlainFormat:
    """For tokenizers without a chat template (the demo's CharTokenizer, ByteTokenizer): the
    messages' text, concatenated; the tokenizer's EOS ends a turn."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.turn_end_ids = tuple(int(i) for i in tokenizer.eos_ids)

    def first_ids(self, messages: Sequence[Message]) -> list[int]:
        return list(self.tokenizer.encode("".join(m.content for m in messages)))

    def next_ids(self, messages: Sequence[Message]) -> list[int]:
        return list(self.tokenizer.encode("".join(m.content for m in messages)))


def chat_format_for(tokenizer: Any, **template_kwargs: Any) -> ChatFormat:
    """The tokenizer's chat format: plain unless it has a chat template."""
    if not getattr(tokenizer, "has_chat_template", False):
        return PlainFormat(tokenizer)
    raise NotImplementedError("chat-template formats are not wired yet")
