"""A Hugging Face tokenizer behind the small interface tasks and the loop use.

`vocab_size`, `pad_id`, `eos_id`, `encode`, `decode`: the same surface as the demo's
`CharTokenizer`, so tasks can take either. Files are read from a local directory only
(`local_files_only=True`) and never run repository code (`trust_remote_code=False`).
Prompts can go through the model's chat template (`chat_prompt`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from jaxreplay import storage
from jaxreplay.models.errors import HFModelError


class HFTokenizer:
    """Wraps a `transformers` tokenizer; ids are plain Python ints."""

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int]):
        """`eos_ids`: every id that ends a completion (the sampler's stop ids; `decode` ends at the first)."""
        if not eos_ids:
            raise HFModelError("tokenizer has no EOS token (neither eos_token nor generation_config.json eos_token_id)")
        self.hf = tokenizer
        self.eos_ids = tuple(int(i) for i in eos_ids)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added special tokens included."""
        return len(self.hf)

    @property
    def eos_id(self) -> int:
        """The first stop id: the tokenizer's eos_token (for chat models, the end of a turn)."""
        return self.eos_ids[0]

    @property
    def pad_id(self) -> int:
        """The tokenizer's pad token, else EOS (masks, not this id, mark padding)."""
        pad = self.hf.pad_token_id
        return self.eos_id if pad is None else int(pad)

    @property
    def bos_id(self) -> Optional[int]:
        bos = self.hf.bos_token_id
        return None if bos is None else int(bos)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; with `add_special_tokens` the tokenizer adds its BOS (Llama) if it has one.

        Off by default: a chat-formatted prompt already holds its special tokens.
        """
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first EOS (any of `eos_ids`), special tokens dropped."""
        out = []
        for i in ids:
            i = int(i)
            if i in self.eos_ids:
                break
            out.append(i)
        return self.hf.decode(out, skip_special_tokens=True)

    def chat_prompt(self, user: str, *, system: Optional[str] = None, **template_kwargs: Any) -> str:
        """`user` (and an optional system message) through the chat template, ending where the
        assistant's reply starts. `template_kwargs` reach the template (e.g. `enable_thinking=False`
        for Qwen3)."""
        if not self.has_chat_template:
            raise HFModelError(f"tokenizer {self.name_or_path} has no chat template: use plain prompts")
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        messages.append({"role": "user", "content": user})
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **template_kwargs)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                    tools: Optional[Sequence[Mapping[str, Any]]] = None, **template_kwargs: Any) -> str:
        """`messages` ({"role", "content"[, "name"]} dicts, roles as HF names them: system, user,
        assistant, tool) through the chat template, as text; `tools` are function descriptions
        the template shows the model. Multi-turn chat formats (tasks/chat.py) render with it."""
        if not self.has_chat_template:
            raise HFModelError(f"tokenizer {self.name_or_path} has no chat template: use plain prompts")
        return self.hf.apply_chat_template([dict(m) for m in messages], tools=None if tools is None else list(tools),
                                           tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **template_kwargs)

    def encode_prompt(self, text: str, *, chat: bool, system: Optional[str] = None,
                      **template_kwargs: Any) -> list[int]:
        """Prompt ids: through the chat template when `chat`, else the raw text after the tokenizer's BOS."""
        if chat:
            return self.encode(self.chat_prompt(text, system=system, **template_kwargs))
        return self.encode(text, add_special_tokens=True)

    @property
    def name_or_path(self) -> str:
        return str(getattr(self.hf, "name_or_path", "?"))

    def check_fits(self, vocab_size: int) -> None:
        """Raises unless every token id has a row in an embedding of `vocab_size` rows."""
        if self.vocab_size > vocab_size:
            raise HFModelError(
                f"tokenizer {self.name_or_path} has {self.vocab_size} tokens but the model's embedding has only "
                f"{vocab_size} rows")

    def save(self, path: str | Path) -> None:
        """Writes the tokenizer files (what `load_tokenizer` reads back) into `path`."""
        self.hf.save_pretrained(str(path))


def load_tokenizer(path: str | Path, *, vocab_size: Optional[int] = None) -> HFTokenizer:
    """The tokenizer in the local directory `path`; with `vocab_size`, checks it fits the embedding.

    Its stop ids (`eos_ids`), derived here and nowhere else: the tokenizer's eos_token
    first, then every `eos_token_id` transformers' `generate` stops on, from
    generation_config.json or, without one, from config.json (chat models often stop
    on both an end-of-turn and an end-of-text token).
    """
    import transformers  # imported here: the demo path never needs it

    path = storage.staged(path)  # a bucket's directory is read from its local copy
    if not path.is_dir():
        raise HFModelError(f"tokenizer directory {path} does not exist")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HFModelError(f"cannot load a tokenizer from {path}: {first}") from None
    eos = [] if tok.eos_token_id is None else [int(tok.eos_token_id)]
    eos += [i for i in _generation_eos_ids(path) if i not in eos]
    wrapped = HFTokenizer(tok, eos)
    if vocab_size is not None:
        wrapped.check_fits(vocab_size)
    return wrapped


def _generation_eos_ids(path: Path) -> list[int]:
    """The `eos_token_id`s transformers' `generate` stops on: generation_config.json's, which
    transformers builds from config.json when the file is absent."""
    for name in ("generation_config.json", "config.json"):
        file = path / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HFModelError(f"{file}: malformed JSON") from None
        value: Any = raw.get("eos_token_id") if isinstance(raw, dict) else None
        ids = [] if value is None else value if isinstance(value, list) else [value]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise HFModelError(f"{file}: eos_token_id must be a token id or a list of them, got {value!r}")
        return ids
    return []
