"""Chat formats: how an episode's messages become token ids around the model's own turns.

Token in, token out: the model's sampled ids go into the episode as they were drawn; a format only
renders the environment's messages and the start of the model's next turn, appended after them.
A model's ids are never decoded and re-encoded for training: a decode/encode round trip can
change them (a token the decoder drops, a different split of the same text), and so the log-probs
the learner re-scores.

`TemplateFormat` renders through the tokenizer's own chat template (HF `apply_chat_template`,
behind `HFTokenizer.render_chat`). Templates rewrite earlier turns (Qwen3's drops `<think>` from
every assistant turn before the last user message), so the conversation is never re-rendered
whole: each observation is rendered after a stand-in assistant turn, and only the text after the
stand-in is kept, which is the template's end of the assistant turn, the new messages and the
start of the next assistant turn.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from jaxreplay.tasks.environment import Message


class ChatFormat(Protocol):
    turn_end_ids: tuple[int, ...]  # ids that end a model turn (the engine's stop ids for a turn)

    def first_ids(self, messages: Sequence[Message]) -> list[int]:
        """The episode's prompt ids, ending where the model's first turn starts."""
        ...

    def next_ids(self, messages: Sequence[Message], *, turn_ended: bool = True) -> list[int]:
        """Ids appended after the model's own ids of its turn: the new messages, then the start of
        the model's next turn. `turn_ended`: the model's ids end in a turn_end id; False when a
        limit cut the turn, and then the format closes the turn itself."""
        ...


class PlainFormat:
    """For tokenizers without a chat template (the demo's CharTokenizer, ByteTokenizer): the
    messages' text, concatenated; the tokenizer's EOS ends a turn."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.turn_end_ids = tuple(int(i) for i in tokenizer.eos_ids)

    def first_ids(self, messages: Sequence[Message]) -> list[int]:
        return list(self.tokenizer.encode("".join(m.content for m in messages)))

    def next_ids(self, messages: Sequence[Message], *, turn_ended: bool = True) -> list[int]:
        return list(self.tokenizer.encode("".join(m.content for m in messages)))


def message_dicts(messages: Sequence[Message]) -> list[dict[str, str]]:
    """Messages as chat templates take them ({"role", "content"}, and "name" for a tool's result)."""
    return [{"role": m.role, "content": m.content, **({"name": m.name} if m.name is not None else {})}
            for m in messages]


class TemplateFormat:
    """Messages through the tokenizer's chat template (an `HFTokenizer` with one).

    `tools`: function descriptions (`ToolRegistry.schemas()`) the template shows the model in the
    first prompt; `template_kwargs` reach the template too (e.g. `enable_thinking=False`, Qwen3).
    A turn ends at any of the tokenizer's EOS ids (for chat models, the end of a turn: Qwen's
    `<|im_end|>`, Llama 3's `<|eot_id|>`/`<|eom_id|>` from generation_config.json).
    """

    STAND_IN = "JAXREPLAY-MODEL-TURN"  # the stand-in assistant turn's text, found again in the rendering

    def __init__(self, tokenizer: Any, *, tools: Sequence[Any] | None = None, **template_kwargs: Any):
        self.tokenizer = tokenizer
        self.turn_end_ids = tuple(int(i) for i in tokenizer.eos_ids)
        self.tools = None if tools is None else list(tools)
        self.template_kwargs = template_kwargs

    def _render(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.render_chat(messages, add_generation_prompt=True, tools=self.tools,
                                          **self.template_kwargs)

    def first_ids(self, messages: Sequence[Message]) -> list[int]:
        return self.tokenizer.encode(self._render(message_dicts(messages)))

    def next_ids(self, messages: Sequence[Message], *, turn_ended: bool = True) -> list[int]:
        """The rendering of `messages` after a stand-in assistant turn, from the stand-in's end on.

        That text starts with the template's end of the assistant turn (`<|im_end|>\n`); the model
        sampled its own turn-end id already, so with `turn_ended` the ids up to and including the
        template's first turn-end id are dropped (the newline after it stays: the template writes
        it, the model never does)."""
        stand_in = [{"role": "user", "content": "?"}, {"role": "assistant", "content": self.STAND_IN}]
        text = self._render(stand_in + message_dicts(messages))
        if text.count(self.STAND_IN) != 1:
            raise ValueError(f"chat template of {self.tokenizer.name_or_path}: the assistant turn's text appears "
                             f"{text.count(self.STAND_IN)} times in its rendering, not once")
        ids = self.tokenizer.encode(text[text.index(self.STAND_IN) + len(self.STAND_IN):])
        if not turn_ended:
            return ids
        end = next((k for k, i in enumerate(ids) if i in self.turn_end_ids), None)
        if end is None:
            raise ValueError(f"chat template of {self.tokenizer.name_or_path} closes an assistant turn with none "
                             f"of the turn-end ids {list(self.turn_end_ids)}")
        return ids[end + 1:]


def chat_format_for(tokenizer: Any, *, environment: Any = None, **template_kwargs: Any) -> ChatFormat:
    """The tokenizer's chat format: its chat template where it has one, else plain text.
    `template_kwargs` (tools=..., enable_thinking=...) reach the template, after those the
    `environment` factory carries as its `chat_template_kwargs` attribute (a tool environment's
    `tools`), so the model sees the tools it may call."""
    if not getattr(tokenizer, "has_chat_template", False):
        return PlainFormat(tokenizer)
    return TemplateFormat(tokenizer, **{**dict(getattr(environment, "chat_template_kwargs", None) or {}),
                                        **template_kwargs})
