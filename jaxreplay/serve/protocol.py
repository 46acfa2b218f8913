"""Request fields and response shapes: OpenAI's completions and chat completions, and vLLM's
token-in/token-out `/inference/v1/generate`. Pure functions of JSON values, no I/O.

Every bad field raises `BadRequest` (a 400, or 413 for a prompt past the context) naming it; a
field this server does not implement is refused, never silently ignored (`UNSUPPORTED`).
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from typing import Any, Optional, Sequence

from jaxreplay.serve.worker import Choice, Draw
from jaxreplay.tasks.tools import MalformedToolCall, parse_tool_calls


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "invalid_request_error", "param": self.param,
                          "code": self.status}}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What a request may ask: the engine's prompt width and token limit, the most choices."""

    prompt_len: int
    max_tokens: int
    max_n: int
    vocab_size: int

    @property
    def max_model_len(self) -> int:
        return self.prompt_len + self.max_tokens


@dataclasses.dataclass
class Sampling:
    n: int
    draw: Draw
    max_tokens: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset
    seed: Optional[int]
    logprobs: Optional[int]  # None: not asked


# Fields OpenAI or vLLM define that this server refuses with a 400, rather than ignore.
UNSUPPORTED = ("best_of", "echo", "suffix", "logit_bias", "presence_penalty", "frequency_penalty",
               "repetition_penalty", "min_p", "min_tokens", "response_format", "guided_json", "guided_regex",
               "use_beam_search", "prompt_logprobs", "ignore_eos", "parallel_tool_calls_strict")


def _get(body: dict, name: str, kinds, default, *, lo=None, hi=None, where: str = ""):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise BadRequest(f"{where}{name} must be {_kind_name(kinds)}, got {json.dumps(value)}", name)
    if not isinstance(value, kinds):
        raise BadRequest(f"{where}{name} must be {_kind_name(kinds)}, got {json.dumps(value)[:80]}", name)
    if lo is not None and value < lo or hi is not None and value > hi:
        raise BadRequest(f"{where}{name} must be in [{lo}, {hi}], got {value}", name)
    return value


def _kind_name(kinds) -> str:
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "a list",
                        dict: "an object"}[k] for k in kinds)


def refuse_unsupported(body: dict, where: str = "") -> None:
    for name in UNSUPPORTED:
        value = body.get(name)
        if value not in (None, False, 0, 1 if name == "best_of" else None):
            raise BadRequest(f"{where}{name} is not supported by this server (docs/serving.md)", name)


def sampling(body: dict, limits: Limits, *, chat: bool, where: str = "") -> Sampling:
    """The sampling fields of a request body (or of vLLM's `sampling_params`)."""
    refuse_unsupported(body, where)
    n = _get(body, "n", int, 1, lo=1, hi=limits.max_n, where=where)
    temperature = float(_get(body, "temperature", (int, float), 1.0, lo=0.0, hi=100.0, where=where))
    top_p = float(_get(body, "top_p", (int, float), 1.0, lo=0.0, hi=1.0, where=where))
    if top_p <= 0:
        raise BadRequest(f"{where}top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", int, 0, lo=-1, hi=limits.vocab_size, where=where)
    top_k = 0 if top_k == -1 else top_k  # vLLM's "off"
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = None
    for name in names:
        if body.get(name) is not None:
            max_tokens = _get(body, name, int, None, lo=1, hi=limits.max_tokens, where=where)
            break
    max_tokens = limits.max_tokens if max_tokens is None else max_tokens
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > 8 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"{where}stop must be a non-empty string or a list of at most 8 of them", "stop")
    stop_ids = _get(body, "stop_token_ids", list, [], where=where)
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in stop_ids):
        raise BadRequest(f"{where}stop_token_ids must be a list of integers", "stop_token_ids")
    seed = _get(body, "seed", int, None, lo=-(2 ** 63), hi=2 ** 63 - 1, where=where)
    if chat:
        wants = _get(body, "logprobs", bool, False, where=where)
        top = _get(body, "top_logprobs", int, 0, lo=0, hi=20, where=where)
        logprobs = top if wants else None
    else:
        logprobs = _get(body, "logprobs", int, None, lo=0, hi=20, where=where)
    return Sampling(n=n, draw=Draw.of(temperature, top_k, top_p), max_tokens=max_tokens, stop=tuple(stop),
                    stop_token_ids=frozenset(stop_ids), seed=None if seed is None else seed % (2 ** 62),
                    logprobs=logprobs)


def check_ids(ids: Any, limits: Limits, name: str) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise BadRequest(f"{name} must be a non-empty list of token ids", name)
    if not all(0 <= i < limits.vocab_size for i in ids):
        raise BadRequest(f"{name} holds an id outside the vocabulary [0, {limits.vocab_size})", name)
    return check_length(ids, limits, name)


def check_length(ids: list[int], limits: Limits, name: str) -> list[int]:
    if len(ids) > limits.prompt_len:
        raise BadRequest(f"the prompt is {len(ids)} tokens; this server takes at most {limits.prompt_len} "
                         f"(max_model_len {limits.max_model_len} = prompt {limits.prompt_len} + completion "
                         f"{limits.max_tokens})", name)
    if not ids:
        raise BadRequest(f"{name} is empty", name)
    return ids


def completion_prompts(body: dict, tokenizer, limits: Limits) -> list[list[int]]:
    """`prompt`: a string, a list of ids, or a list of either (one generation each)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        prompts = prompt
    else:
        raise BadRequest("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")
    if len(prompts) > limits.max_n:
        raise BadRequest(f"at most {limits.max_n} prompts a request", "prompt")
    return [check_length(tokenizer.encode(p), limits, "prompt") if isinstance(p, str) else
            check_ids(p, limits, "prompt") for p in prompts]


def chat_prompt(body: dict, tokenizer, limits: Limits) -> tuple[list[int], Optional[list]]:
    """The conversation through the tokenizer's own chat template (and its tools)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadRequest("messages must be a non-empty list of objects with a role", "messages")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and t["function"].get("name")
            for t in tools)):
        raise BadRequest("tools must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}", "tools")
    if body.get("tool_choice") not in (None, "auto", "none"):
        raise BadRequest("tool_choice may only be \"auto\" or \"none\" here (docs/serving.md)", "tool_choice")
    if body.get("tool_choice") == "none":
        tools = None
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
    if not getattr(tokenizer, "has_chat_template", False):
        raise BadRequest("this model's tokenizer has no chat template: use /v1/completions", "messages")
    rendered = [_message_for_template(m) for m in messages]
    try:
        text = tokenizer.render_chat(rendered, add_generation_prompt=True, tools=tools, **kwargs)
    except Exception as e:  # a template that refuses the conversation (roles out of order, ...)
        raise BadRequest(f"the chat template refused these messages: {e}", "messages") from None
    return check_length(tokenizer.encode(text), limits, "messages"), tools


def _message_for_template(m: dict) -> dict:
    """A message as chat templates take it: content text (parts joined), tool calls' arguments
    as objects (OpenAI sends them as JSON strings)."""
    out = dict(m)
    content = out.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise BadRequest("only text content parts are supported", "messages")
        out["content"] = "".join(p.get("text", "") for p in content)
    elif content is None:
        out["content"] = ""
    elif not isinstance(content, str):
        raise BadRequest("a message's content must be a string or a list of text parts", "messages")
    calls = []
    for call in out.get("tool_calls") or []:
        fn = dict((call or {}).get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = json.loads(fn["arguments"])
            except json.JSONDecodeError:
                raise BadRequest("a tool call's arguments are not JSON", "messages") from None
        calls.append({**call, "function": fn})
    if calls:
        out["tool_calls"] = calls
    return out


# -- responses ---------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def now() -> int:
    return int(time.time())


def token_piece(tokenizer, token: int) -> str:
    """One id's text as log-prob entries name it (special tokens included)."""
    hf = getattr(tokenizer, "hf", None)
    if hf is not None:
        return hf.decode([int(token)], skip_special_tokens=False)
    return tokenizer.decode([int(token)])


def completion_logprobs(tokenizer, choice: Choice, offset: int, count: int, text_offset: int) -> dict:
    """OpenAI's completions `logprobs` for tokens [offset, offset + count): each sampled token's
    log-prob under the distribution it was drawn from; top_logprobs hold that token only."""
    pieces = [token_piece(tokenizer, t) for t in choice.tokens[offset:offset + count]]
    lps = choice.logprobs[offset:offset + count]
    offsets, at = [], text_offset
    for p in pieces:
        offsets.append(at)
        at += len(p)
    return {"tokens": pieces, "token_logprobs": lps, "top_logprobs": [{p: lp} for p, lp in zip(pieces, lps)],
            "text_offset": offsets}


def chat_logprobs(tokenizer, choice: Choice, offset: int, count: int, top: int, *, as_ids: bool = False) -> dict:
    content = []
    for t, lp in zip(choice.tokens[offset:offset + count], choice.logprobs[offset:offset + count]):
        piece = f"token_id:{t}" if as_ids else token_piece(tokenizer, t)
        entry = {"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8"))}
        content.append({**entry, "top_logprobs": [entry] if top > 0 else []})
    return {"content": content}


def visible_text(tokenizer, choice: Choice) -> str:
    """The choice's text: up to its first EOS, a stop string cut off (OpenAI's rule)."""
    text = tokenizer.decode(choice.tokens)
    if choice.stop_text is not None and choice.stop_text in text:
        text = text[:text.index(choice.stop_text)]
    return text


def tool_calls_of(text: str, call_format: str) -> tuple[Optional[str], list[dict]]:
    """(the content left, OpenAI `tool_calls`) of a finished turn; a turn whose call does not
    parse stays text, with no calls."""
    try:
        calls = parse_tool_calls(text, call_format)
    except MalformedToolCall:
        return text, []
    if not calls:
        return text, []
    content = text.split("<tool_call>")[0].strip() if call_format == "qwen" else ""
    return content or None, [{"id": f"call_{secrets.token_hex(12)}", "type": "function",
                              "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
                             for c in calls]


def usage(prompt_tokens: int, choices: Sequence[Choice]) -> dict:
    completion = sum(len(c.tokens) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
