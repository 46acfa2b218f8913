"""Chat formats for multi-turn episodes (tasks/chat.py): observations rendered through the
tokenizer's own chat template, only the new messages, after the model's own ids, never re-tokenised."""

import pytest

from jaxreplay.models.tokenizer import load_tokenizer
from jaxreplay.tasks.arithmetic import CharTokenizer
from jaxreplay.tasks.chat import PlainFormat, TemplateFormat, chat_format_for, message_dicts
from jaxreplay.tasks.environment import Message
from jaxreplay.tasks.tools import CALCULATOR, ToolEnvironment, ToolRegistry, calculator_environment
from tests.tiny_hf import LLAMA3_TOOLS, QWEN_TOOLS, write_char_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen_tools")
    write_char_tokenizer(path, QWEN_TOOLS)
    return load_tokenizer(path)


TOOLS = ToolRegistry([CALCULATOR]).schemas()
FIRST = (Message("system", "Be brief."), Message("user", "12*34=?"))
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'


def episode(fmt, tok, turns, observations):
    """The ids an engine assembles: the first prompt, then each model turn's own ids followed by the
    format's ids for what the environment said."""
    ids = fmt.first_ids(FIRST)
    spans = []
    for k, turn in enumerate(turns):
        spans.append((len(ids), len(ids) + len(turn)))
        ids += turn
        if k < len(observations):
            ids += fmt.next_ids(observations[k])
    return ids, spans


def test_template_format_is_chosen_for_a_tokenizer_with_a_template(tok):
    assert isinstance(chat_format_for(tok, tools=TOOLS), TemplateFormat)
    shown = chat_format_for(tok, environment=calculator_environment).first_ids(FIRST)  # the factory's tools
    assert shown == chat_format_for(tok, tools=TOOLS).first_ids(FIRST) != chat_format_for(tok).first_ids(FIRST)
    assert isinstance(chat_format_for(CharTokenizer()), PlainFormat)
    assert chat_format_for(tok).turn_end_ids == tok.eos_ids


def test_incremental_ids_equal_the_whole_conversation_through_the_template(tok):
    """With tool results (grouped into one turn by the template) and a user message between the
    model's turns, the pieces equal the template's rendering of the whole conversation."""
    fmt = chat_format_for(tok, tools=TOOLS)
    end = [tok.eos_id]
    texts = [CALL + CALL, "It is 408, check: 408/34=12", "408"]
    turns = [tok.encode(t) + end for t in texts]
    observations = [(Message("tool", "408", name="calculator"), Message("tool", "12", name="calculator")),
                    (Message("user", "Final answer only."),)]
    ids, _ = episode(fmt, tok, turns, observations)
    conversation = list(FIRST)
    for k, text in enumerate(texts[:-1]):
        conversation += [Message("assistant", text), *observations[k]]
    whole = tok.render_chat(message_dicts(conversation), add_generation_prompt=True, tools=TOOLS)
    assert "<tool_response>\n408\n</tool_response>\n<tool_response>\n12" in whole
    assert ids == tok.encode(whole) + turns[-1]


def test_model_ids_stay_as_sampled_even_where_decode_and_encode_differ(tok):
    """Token in, token out. The first turn holds a special token that decoding drops and a <think>
    block that the template drops from earlier turns: re-rendering the conversation from decoded
    text would give other ids, so this fails if any step re-tokenises the model's turn."""
    fmt = chat_format_for(tok, tools=TOOLS)
    env = ToolEnvironment(ToolRegistry([CALCULATOR]))
    env.reset({"question": "12*34=?", "answer": "408"}, seed=0)
    turn1 = tok.encode("<think>12*34?</think>") + [tok.hf.convert_tokens_to_ids("<|endoftext|>")] + \
        tok.encode(CALL) + [tok.eos_id]
    text1 = tok.decode(turn1)  # what the environment reads
    assert tok.encode(text1) + [tok.eos_id] != turn1  # the round trip loses the special token
    step = env.step(text1)
    assert step.observation == (Message("tool", "408", name="calculator"),) and not step.done
    turn2 = tok.encode("408") + [tok.eos_id]
    ids, spans = episode(fmt, tok, [turn1, turn2], [step.observation, (Message("user", "Sure?"),)])
    assert [ids[a:b] for a, b in spans] == [turn1, turn2]
    retokenised = tok.render_chat(message_dicts([*FIRST, Message("assistant", text1), *step.observation,
                                                 Message("assistant", "408"), Message("user", "Sure?")]),
                                  add_generation_prompt=True, tools=TOOLS)
    assert "<think>" not in retokenised  # the template rewrote the earlier turn
    assert ids != tok.encode(retokenised)
    assert env.step(tok.decode(turn2)).reward == 1.0


def test_next_ids_start_after_the_sampled_turn_end(tok):
    """The model sampled <|im_end|>: the format adds only the newline the template writes after it;
    a turn cut by a limit gets the template's own end of turn."""
    fmt = chat_format_for(tok)
    obs = (Message("user", "more"),)
    ended, cut = fmt.next_ids(obs), fmt.next_ids(obs, turn_ended=False)
    assert tok.hf.decode(ended) == "\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n"
    assert cut == [tok.eos_id] + ended


def test_first_ids_are_the_templates_prompt(tok):
    fmt = chat_format_for(tok, tools=TOOLS)
    text = tok.hf.decode(fmt.first_ids(FIRST))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n<tools>\n{") and '"calculator"' in text
    assert text.endswith("<|im_start|>user\n12*34=?<|im_end|>\n<|im_start|>assistant\n")


def test_plain_format_concatenates_text():
    tok = CharTokenizer()
    fmt = chat_format_for(tok)
    assert fmt.first_ids((Message("user", "1+2"), Message("user", "="))) == tok.encode("1+2=")
    assert fmt.next_ids((Message("user", "+"),)) == tok.encode("+")
    assert fmt.turn_end_ids == tuple(tok.eos_ids)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3_tools")
    write_char_tokenizer(path, LLAMA3_TOOLS, llama3=True)
    return load_tokenizer(path)


def test_llama3_style_template_tool_results_under_ipython_and_eom_ends_a_turn(llama):
    """A turn closed by <|eot_id|> with nothing after it; the model may end a tool-calling turn
    with <|eom_id|> (the second stop id), which the format keeps and does not close again."""
    fmt = chat_format_for(llama, tools=TOOLS)
    eot, eom = llama.eos_ids
    call = '{"name": "calculator", "parameters": {"expression": "6*7"}}'
    turn1 = [llama.hf.convert_tokens_to_ids("<|python_tag|>")] + llama.encode(call) + [eom]
    env = ToolEnvironment(ToolRegistry([CALCULATOR]), call_format="llama3")
    env.reset(("6*7=", "42"), seed=0)
    step = env.step(llama.decode(turn1))
    assert step.observation == (Message("tool", "42", name="calculator"),)
    turn2 = llama.encode("42") + [eot]
    ids, spans = episode(fmt, llama, [turn1, turn2], [step.observation])
    assert [ids[a:b] for a, b in spans] == [turn1, turn2]
    between = llama.hf.decode(ids[spans[0][1]:spans[1][0]])
    assert between == ("<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>"
                       "<|start_header_id|>assistant<|end_header_id|>\n\n")
    first = llama.hf.decode(fmt.first_ids(FIRST))
    assert first.startswith("<s><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert env.step(llama.decode(turn2)).reward == 1.0
