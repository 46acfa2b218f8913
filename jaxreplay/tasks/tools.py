"""Tool use: Python tools the policy calls in its model family's own format, and the environment
that runs them.

A model calls tools the way it was fine-tuned to: Qwen2.5/Qwen3 write
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (any number per turn), Llama 3.1/3.2 write
one bare JSON object `{"name": ..., "parameters": {...}}` as the whole turn (after `<|python_tag|>`
when the system prompt says `Environment: ipython`), and Llama 3.2's small models and Llama 4 a
Python list of calls, `[f(x=1)]`. `ToolEnvironment` parses each turn: calls run
their registered tools (each in its own thread, with a timeout) and come back as role "tool"
messages; a turn with no call is the final answer and ends the episode with the answer's reward; a
call that does not parse is a malformed tool call, penalised or ending the episode as configured.

Tools run in this process with no sandbox: register only functions that are safe on any input the
model can write (docs/security.md).
"""

from __future__ import annotations

import ast
import json
import operator
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

from jaxreplay.tasks.environment import Message, Step, register_environment
from jaxreplay.tasks.rewards import get_reward


@dataclass(frozen=True)
class Tool:
    """A Python function the model may call, with the description its chat template shows it."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # a JSON schema of the arguments ({"type": "object", "properties": ...})
    fn: Callable[..., Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI/HF function description that `apply_chat_template(tools=...)` renders."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


class ToolRegistry:
    """Tools by name; `schemas()` is what the chat template's `tools=` argument takes."""

    def __init__(self, tools: Sequence[Tool] = ()):
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> Tool:
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return tool

    def __contains__(self, name: str) -> bool:
        return name in self._tools

    def __getitem__(self, name: str) -> Tool:
        return self._tools[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [tool.schema() for tool in self._tools.values()]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


class MalformedToolCall(ValueError):
    """A turn that tries to call a tool but does not parse (its message says why, for the model)."""


def _call_from(obj: Any, args_key: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise MalformedToolCall('a tool call is a JSON object with a "name" string')
    other = "parameters" if args_key == "arguments" else "arguments"  # the other family's key is read too
    args = obj[args_key] if args_key in obj else obj.get(other, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise MalformedToolCall(f"the arguments of {obj['name']!r} are not JSON: {e.msg}") from None
    if not isinstance(args, dict):
        raise MalformedToolCall(f'the "{args_key}" of {obj["name"]!r} must be a JSON object')
    return ToolCall(obj["name"], args)


_QWEN_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_qwen(text: str) -> list[ToolCall]:
    """Qwen2.5/Qwen3 (Hermes style): every `<tool_call>{"name", "arguments"}</tool_call>` in the turn.

    No `<tool_call>` tag: no call (the turn is an answer). A tag left open or a body that is not
    a call object: `MalformedToolCall`."""
    calls = []
    for body in _QWEN_CALL.findall(text):
        try:
            obj = json.loads(body.strip())
        except json.JSONDecodeError as e:
            raise MalformedToolCall(f"a <tool_call> body is not JSON: {e.msg}") from None
        calls.append(_call_from(obj, "arguments"))
    if text.count("<tool_call>") != len(calls) or text.count("</tool_call>") != len(calls):
        raise MalformedToolCall("a <tool_call> tag is not closed by </tool_call>")
    return calls


_PYTHON_TAG = "<|python_tag|>"


def parse_llama3(text: str) -> list[ToolCall]:
    """Llama 3.1/3.2 JSON tool calling: the whole turn is `{"name": ..., "parameters": {...}}`
    (Meta's documented zero-shot format; `arguments` is read too), optionally after
    `<|python_tag|>`, or a JSON list of such objects.

    A turn that starts with `{`, `[` or the python tag is a call and must parse; any other turn is
    an answer. Pythonic calls (`[f(x=1)]`) are `parse_pythonic`'s; the built-in tools' Python code
    is not read."""
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):].strip()
    if not tagged and not body.startswith(("{", "[")):
        return []
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise MalformedToolCall(f"the tool call is not JSON: {e.msg}") from None
    objs = obj if isinstance(obj, list) else [obj]
    if not objs:
        raise MalformedToolCall("an empty list of tool calls")
    return [_call_from(o, "parameters") for o in objs]


_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"
_PYTHONIC_CALL = re.compile(r"\[\s*[A-Za-z_]\w*\s*\(")


def parse_pythonic(text: str) -> list[ToolCall]:
    """Pythonic tool calling (Llama 3.2 1B/3B's tool prompt, Llama 4): the whole turn is a Python
    list of calls with keyword arguments, `[f(x=1, y="a"), g()]`, Llama 4's optionally between
    `<|python_start|>` and `<|python_end|>`.

    A turn that opens as such a list (`[` then a name and `(`) or with the start tag is a call and
    must parse; any other turn is an answer. Only the syntax is read (`ast`), never run: each
    argument must be a Python literal."""
    body = text.strip()
    tagged = body.startswith(_PYTHON_START)
    if tagged:
        body = body[len(_PYTHON_START):].removesuffix(_PYTHON_END).strip()
    if not tagged and not _PYTHONIC_CALL.match(body):
        return []
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise MalformedToolCall(f"the tool call is not a Python list of calls: {getattr(e, 'msg', e)}") from None
    if not isinstance(tree, ast.List) or not tree.elts:
        raise MalformedToolCall("the tool calls are a Python list such as [f(x=1)]")
    return [_pythonic_call(node) for node in tree.elts]


def _pythonic_call(node: ast.expr) -> ToolCall:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise MalformedToolCall("each item of the list is a call of a tool by its name, such as f(x=1)")
    name = node.func.id
    if node.args or any(kw.arg is None for kw in node.keywords):
        raise MalformedToolCall(f"the arguments of {name!r} are passed by name, such as {name}(x=1)")
    arguments = {}
    for kw in node.keywords:
        try:
            arguments[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
            raise MalformedToolCall(f"the argument {kw.arg!r} of {name!r} is not a literal") from None
    return ToolCall(name, arguments)


# The tool-call formats by the name configs give them.
CALL_FORMATS: dict[str, Callable[[str], list[ToolCall]]] = {
    "qwen": parse_qwen,
    "llama3": parse_llama3,
    "pythonic": parse_pythonic,
}


def parse_tool_calls(text: str, call_format: str) -> list[ToolCall]:
    if call_format not in CALL_FORMATS:
        raise ValueError(f"unknown tool-call format {call_format!r} (known: {', '.join(CALL_FORMATS)})")
    return CALL_FORMATS[call_format](text)


class ToolFailed(Exception):
    """A tool raised or ran out of time: `kind` is "exception" or "timeout" (Step.info["error"])."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def run_tool(tool: Tool, arguments: Mapping[str, Any], timeout_s: float) -> str:
    """The tool's result as text, or `ToolFailed`. It runs in a daemon thread so that a slow tool
    costs at most `timeout_s`; Python cannot kill a thread, so a tool that never returns leaks its
    thread: tools that can block forever belong in a worker process (the rollout stage's pool)."""
    out: dict[str, Any] = {}

    def call() -> None:
        try:
            out["value"] = tool.fn(**arguments)
        except BaseException as e:  # noqa: BLE001 - any failure of the tool is the model's to read
            out["error"] = e

    thread = threading.Thread(target=call, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise ToolFailed("timeout", f"{tool.name} timed out after {timeout_s:g} s")
    if "error" in out:
        e = out["error"]
        raise ToolFailed("exception", f"{tool.name} raised {type(e).__name__}: {e}")
    value = out["value"]
    return value if isinstance(value, str) else json.dumps(value)


def item_question(item: Any) -> str:
    """The question of a task item: a (prompt, answer) pair, a mapping with "question" or
    "prompt", or an object with `.text` (the arithmetic task's problems) or `.prompt` (a dataset's
    examples, before the task's prompt template)."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return str(item[0])
    if isinstance(item, Mapping):
        return str(item["question"] if "question" in item else item["prompt"])
    return str(item.text if hasattr(item, "text") else item.prompt)


def item_answer(item: Any) -> str:
    """The reference answer of a task item, read as `item_question` reads its question."""
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return str(item[1])
    if isinstance(item, Mapping):
        return str(item["answer"])
    return str(item.answer)


class ToolEnvironment:
    """An episode in which the model may call tools before it answers (the contract's Environment).

    `reset` says the item's question (after `system`, if any). Each `step` reads the model's turn:
    - tool calls: each runs (at most `max_calls_per_turn`), its result or error comes back as a
      role "tool" message; reward 0, not done. A tool that raises or times out gives the model an
      error message and marks info["error"] ("exception" / "timeout"), and the episode goes on;
    - no call: the final answer; reward = `reward(answer_text, item's answer)`, done;
    - a malformed call: info["error"] = "malformed_tool_call"; with `on_malformed` "end" the
      episode ends with reward `malformed_reward`; with "penalise" the model is told what is wrong
      (a user message), the turn's reward is `malformed_reward`, and the episode goes on.
    """

    def __init__(self, tools: ToolRegistry, *, call_format: str = "qwen", reward: str = "exact_match",
                 system: Optional[str] = None, tool_timeout_s: float = 5.0, max_calls_per_turn: int = 4,
                 on_malformed: str = "end", malformed_reward: float = 0.0):
        if call_format not in CALL_FORMATS:
            raise ValueError(f"unknown tool-call format {call_format!r} (known: {', '.join(CALL_FORMATS)})")
        if on_malformed not in ("end", "penalise"):
            raise ValueError(f"on_malformed must be 'end' or 'penalise', not {on_malformed!r}")
        if tool_timeout_s <= 0 or max_calls_per_turn < 1:
            raise ValueError("tool_timeout_s must be > 0 and max_calls_per_turn >= 1")
        self.tools = tools
        self.call_format = call_format
        self.reward_fn = get_reward(reward)
        self.system = system
        self.tool_timeout_s = float(tool_timeout_s)
        self.max_calls_per_turn = int(max_calls_per_turn)
        self.on_malformed = on_malformed
        self.malformed_reward = float(malformed_reward)
        self.item: Any = None

    def reset(self, item: Any, seed: int) -> tuple[Message, ...]:
        self.item = item
        first = (Message("system", self.system),) if self.system is not None else ()
        return first + (Message("user", item_question(item)),)

    def step(self, turn_text: str) -> Step:
        try:
            calls = parse_tool_calls(turn_text, self.call_format)
            if any(call.name not in self.tools for call in calls):
                unknown = next(call.name for call in calls if call.name not in self.tools)
                raise MalformedToolCall(f"no tool named {unknown!r} (tools: {', '.join(self.tools.names())})")
            if len(calls) > self.max_calls_per_turn:
                raise MalformedToolCall(f"{len(calls)} tool calls in one turn (at most {self.max_calls_per_turn})")
        except MalformedToolCall as e:
            info = {"error": "malformed_tool_call", "why": str(e)}
            if self.on_malformed == "end":
                return Step(reward=self.malformed_reward, done=True, info=info)
            return Step(observation=(Message("user", f"Malformed tool call: {e}"),), reward=self.malformed_reward,
                        info=info)
        if not calls:
            return Step(reward=float(self.reward_fn(turn_text, item_answer(self.item))), done=True)
        messages, info = [], {}
        for call in calls:
            try:
                result = run_tool(self.tools[call.name], call.arguments, self.tool_timeout_s)
            except ToolFailed as e:
                info.setdefault("error", e.kind)
                result = f"error: {e}"
            messages.append(Message("tool", result, name=call.name))
        return Step(observation=tuple(messages), info=info)


_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


def calculate(expression: str) -> str:
    """+ - * / // % and parentheses on numbers: parsed, never `eval`ed; large powers are not offered."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            return -value(node.operand) if isinstance(node.op, ast.USub) else value(node.operand)
        raise ValueError(f"not arithmetic: {ast.unparse(node)}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if isinstance(result, float) and result.is_integer() else result)


CALCULATOR = Tool(
    "calculator", "Evaluates an arithmetic expression (+ - * / // % and parentheses) and returns its value.",
    {"type": "object", "properties": {"expression": {"type": "string", "description": "e.g. (12+7)*3"}},
     "required": ["expression"]},
    lambda expression: calculate(expression))


def calculator_environment(**options: Any) -> ToolEnvironment:
    """The shipped tool environment (`environment.name: calculator`): the task's question, one
    calculator tool, the final answer scored by `reward` (exact_match unless the options say).
    A factory of your own tells the chat template its tools the same way: `chat_template_kwargs`."""
    return ToolEnvironment(ToolRegistry([CALCULATOR]), **options)


# What the chat template shows the model (chat.chat_format_for(tokenizer, environment=factory) reads it).
calculator_environment.chat_template_kwargs = {"tools": ToolRegistry([CALCULATOR]).schemas()}
register_environment("calculator", calculator_environment)
