"""Tool calls in the model family's own format, and the environment that runs them (tasks/tools.py)."""

import threading
import time

import pytest

from jaxreplay.tasks.arithmetic import Problem
from jaxreplay.tasks.datasets import Example
from jaxreplay.tasks.environment import Message, make_environment
from jaxreplay.tasks.tools import (CALCULATOR, MalformedToolCall, Tool, ToolCall, ToolEnvironment, ToolRegistry,
                                   calculate, parse_llama3, parse_pythonic, parse_qwen)

ANY = {"type": "object", "properties": {}}


def qwen(name, **arguments):
    import json
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_qwen_calls_are_every_tool_call_block():
    text = "Let me add.\n" + qwen("calculator", expression="1+2") + qwen("lookup", key="x") + "\n"
    assert parse_qwen(text) == [ToolCall("calculator", {"expression": "1+2"}), ToolCall("lookup", {"key": "x"})]
    assert parse_qwen("The answer is 3.") == []
    assert parse_qwen('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == [ToolCall("f", {"a": 1})]


@pytest.mark.parametrize("text, why", [
    ('<tool_call>{"name": "f", "arguments": {}}', "not closed"),
    ('<tool_call>{"name": "f", "arguments": {</tool_call>', "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "JSON object"),
    ('<tool_call>[]</tool_call>', '"name"'),
])
def test_qwen_malformed_calls_say_why(text, why):
    with pytest.raises(MalformedToolCall, match=why):
        parse_qwen(text)


def test_llama3_calls_are_a_json_turn():
    call = ToolCall("calculator", {"expression": "6*7"})
    assert parse_llama3('{"name": "calculator", "parameters": {"expression": "6*7"}}') == [call]
    assert parse_llama3('<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}') == [call]
    assert parse_llama3('{"name": "calculator", "arguments": {"expression": "6*7"}}') == [call]
    assert parse_llama3('[{"name": "calculator", "parameters": {"expression": "6*7"}}, {"name": "g"}]') == [
        call, ToolCall("g", {})]
    assert parse_llama3("It is 42.") == []


@pytest.mark.parametrize("text", ['{"name": "calculator", "parameters": ', "<|python_tag|>print(1)", "[]",
                                  '{"parameters": {}}'])
def test_llama3_malformed_calls(text):
    with pytest.raises(MalformedToolCall):
        parse_llama3(text)


def test_pythonic_calls_are_a_python_list_of_calls_read_never_run():
    assert parse_pythonic('[calculator(expression="6*7")]') == [ToolCall("calculator", {"expression": "6*7"})]
    assert parse_pythonic("[f(x=1, y=[2, 'a'], z={'k': None}), g()]\n") == [
        ToolCall("f", {"x": 1, "y": [2, "a"], "z": {"k": None}}), ToolCall("g", {})]
    assert parse_pythonic('<|python_start|>[f(x=True)]<|python_end|>') == [ToolCall("f", {"x": True})]
    for answer in ("It is 42.", "[1, 2]", "[the answer] is 3", "42"):
        assert parse_pythonic(answer) == []


@pytest.mark.parametrize("text, why", [
    ("[f(x=1)", "not a Python list"),
    ("[f(1)]", "passed by name"),
    ("[f(**{'x': 1})]", "passed by name"),
    ("[f(x=__import__('os').getcwd())]", "not a literal"),
    ("[f(x=true)]", "not a literal"),
    ("[f(x=1)] then more text", "not a Python list"),
    ("[f(x=1), 3]", "a call of a tool"),
    ("<|python_start|>print(1)<|python_end|>", "a Python list"),
    ("<|python_start|>[]", "a Python list"),
])
def test_pythonic_malformed_calls_say_why(text, why):
    with pytest.raises(MalformedToolCall, match=why):
        parse_pythonic(text)


def test_calculator_computes_and_refuses_code():
    assert calculate("(12+7)*3 - 10/4") == "54.5" and calculate("408/34") == "12"
    for bad in ("__import__('os').system('true')", "2**999999", "[1]*9", "a+1"):
        with pytest.raises((ValueError, SyntaxError)):
            calculate(bad)


def test_tool_environment_runs_calls_then_scores_the_answer():
    env = make_environment("calculator", {"system": "Use the calculator."})
    problem = Problem(12, "*", 34, width=2)
    assert env.reset(problem, seed=0) == (Message("system", "Use the calculator."), Message("user", "12*34="))
    step = env.step("I will compute. " + qwen("calculator", expression="12*34"))
    assert step == type(step)(observation=(Message("tool", "408", name="calculator"),), reward=0.0, done=False)
    assert env.step("408") == type(step)(reward=1.0, done=True)
    env.reset({"question": "12*34=", "answer": "408"}, seed=1)
    assert env.step("407").reward == 0.0 and env.step("407").done
    assert env.reset(Example(0, "6*7=", "42", (1, 2)), seed=2)[-1] == Message("user", "6*7=")  # a dataset's item
    assert env.step("42").reward == 1.0


def slow(seconds):
    time.sleep(seconds)
    return "late"


def boom():
    raise RuntimeError("disk on fire")


def test_a_tool_that_raises_or_times_out_tells_the_model_and_is_counted():
    tools = ToolRegistry([Tool("slow", "sleeps", ANY, slow), Tool("boom", "raises", ANY, boom), CALCULATOR])
    env = ToolEnvironment(tools, tool_timeout_s=0.2)
    env.reset(("1+1=", "2"), seed=0)
    step = env.step(qwen("boom"))
    assert step.info["error"] == "exception" and not step.done
    assert step.observation == (Message("tool", "error: boom raised RuntimeError: disk on fire", name="boom"),)
    start = time.monotonic()
    step = env.step(qwen("slow", seconds=30) + qwen("calculator", expression="1+1"))
    assert time.monotonic() - start < 5
    assert step.info["error"] == "timeout" and not step.done
    assert [m.content for m in step.observation] == ["error: slow timed out after 0.2 s", "2"]
    assert env.step("2").reward == 1.0


def test_malformed_calls_end_or_penalise_as_configured():
    end = ToolEnvironment(ToolRegistry([CALCULATOR]), malformed_reward=-0.5)
    end.reset(("1+1=", "2"), seed=0)
    step = end.step("<tool_call>{oops</tool_call>")
    assert step.done and step.reward == -0.5 and step.info["error"] == "malformed_tool_call"
    penalise = ToolEnvironment(ToolRegistry([CALCULATOR]), on_malformed="penalise", malformed_reward=-0.1)
    penalise.reset(("1+1=", "2"), seed=0)
    step = penalise.step(qwen("rm", path="/"))
    assert not step.done and step.reward == -0.1 and step.info["error"] == "malformed_tool_call"
    assert step.observation[0].role == "user" and "no tool named 'rm'" in step.observation[0].content
    assert penalise.step(qwen("calculator", expression="1+1") * 5).info["error"] == "malformed_tool_call"
    assert penalise.step("2").reward == 1.0


def test_llama3_format_environment():
    env = ToolEnvironment(ToolRegistry([CALCULATOR]), call_format="llama3")
    env.reset(("6*7=", "42"), seed=0)
    step = env.step('{"name": "calculator", "parameters": {"expression": "6*7"}}')
    assert step.observation == (Message("tool", "42", name="calculator"),)
    assert env.step("42").reward == 1.0


def test_pythonic_format_environment():
    env = ToolEnvironment(ToolRegistry([CALCULATOR]), call_format="pythonic")
    env.reset(("6*7=", "42"), seed=0)
    step = env.step('[calculator(expression="6*7")]')
    assert step.observation == (Message("tool", "42", name="calculator"),)
    assert env.step("[calculator(6*7)]").info["error"] == "malformed_tool_call"
    assert env.step("42").reward == 1.0


def test_bad_options_are_refused():
    for options in ({"call_format": "mistral"}, {"on_malformed": "ignore"}, {"tool_timeout_s": 0},
                    {"reward": "nope"}):
        with pytest.raises(ValueError):
            make_environment("calculator", options)
    with pytest.raises(ValueError, match="already registered"):
        ToolRegistry([CALCULATOR, CALCULATOR])


def test_a_hung_tool_leaves_the_environment_usable():
    """Each call runs in its own daemon thread: a hung tool leaves the environment usable."""
    gate = threading.Event()
    env = ToolEnvironment(ToolRegistry([Tool("hang", "waits", ANY, lambda: gate.wait(60) and "done"), CALCULATOR]),
                          tool_timeout_s=0.1)
    env.reset(("2+2=", "4"), seed=0)
    assert env.step(qwen("hang")).info["error"] == "timeout"
    assert env.step(qwen("calculator", expression="2+2")).observation[0].content == "4"
    gate.set()


def test_the_calculator_runs_in_a_killable_worker_process():
    """Named as module:factory, the tool environment runs in the pool's spawned worker: what it
    says (tool messages) crosses the process boundary intact."""
    from jaxreplay.tasks.environment import EnvPool
    pool = EnvPool("jaxreplay.tasks.tools:calculator_environment", {"on_malformed": "penalise"}, workers=1,
                   processes=True, timeout=30)
    try:
        env = pool.create()
        assert pool.reset([env], ("12*34=", "408"), seed=0) == [(Message("user", "12*34="),)]
        answers = []
        for turn in (qwen("calculator", expression="12*34"), "<tool_call>oops", "408"):
            pool.step(env, turn)
            got = []
            while not got:
                got = pool.results(30)
            answers.append(got[0][1])
        assert answers[0].observation == (Message("tool", "408", name="calculator"),)
        assert answers[1].info["error"] == "malformed_tool_call" and not answers[1].done
        assert answers[2].done and answers[2].reward == 1.0
    finally:
        pool.shutdown()
