"""Tiny Hugging Face model directories made here (no hub): weights from our own exporter and a
character-level tokenizer with a ChatML chat template."""

import json
from pathlib import Path

from jaxreplay.config import ModelConfig
from jaxreplay.models.hf import save_hf_model
from jaxreplay.models.transformer import init_params

WORDS = ["<pad>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(32, 127)] + ["\n"]


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen-style ChatML with tools, written here after Qwen2.5/Qwen3's behaviour: the tools' descriptions in the
# system turn, consecutive tool results grouped in one user turn as <tool_response> blocks, and (as Qwen3's
# does) `<think>...</think>` dropped from every assistant turn before the last user message. HF renders with
# trim_blocks (a newline right after a block tag is dropped), hence {{ '\\n' }} after one.
QWEN_TOOLS = (
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}{% if not tools %}<|im_start|>system\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% if loop.index0 < ns.last_user %}{{ m.content.split('</think>')[-1].lstrip('\n') }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Llama 3.1-style headers, written here after its template: tools as JSON in the system turn, a tool's
# result under the `ipython` header, each turn closed by <|eot_id|> with no newline after it.
LLAMA3_TOOLS = (
    "<s>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>"
    "{{ '\\n\\n' }}{{ m.content | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}")
LLAMA3_SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]

# Gemma-style turns, written here after Gemma 2/3's behaviour: no system role, so a system message's text
# opens the first user turn, followed by a blank line; the assistant is `model`; each turn ends with
# <end_of_turn> and a newline; roles must alternate user/model.
GEMMA = (
    "{{ bos_token }}{% if messages[0].role == 'system' %}{% set prefix = messages[0].content | trim + '\n\n' %}"
    "{% set turns = messages[1:] %}{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for m in turns %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/model') }}{% endif %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{{ prefix if loop.first else '' }}{{ m.content | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
GEMMA_SPECIAL = ["<start_of_turn>", "<end_of_turn>"]


def write_char_tokenizer(path: Path, chat_template: str = CHATML, *, llama3: bool = False) -> None:
    """101 ids; EOS = <|im_end|>; `{% if add_generation_prompt %}` opens the assistant turn.
    `chat_template`: plain ChatML, or QWEN_TOOLS (a tool role and tools). With `llama3`, five more
    ids (LLAMA3_SPECIAL) and EOS = <|eot_id|>, then <|eom_id|> (generation_config.json): for LLAMA3_TOOLS.
    With GEMMA, two more ids (GEMMA_SPECIAL) and EOS = <end_of_turn>."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    gemma = chat_template == GEMMA
    words = WORDS + (LLAMA3_SPECIAL if llama3 else []) + (GEMMA_SPECIAL if gemma else [])
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    eos = "<|eot_id|>" if llama3 else "<end_of_turn>" if gemma else "<|im_end|>"
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token=eos,
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"] + (["<|im_end|>", *LLAMA3_SPECIAL] if llama3
                                                                       else ["<|im_end|>"] if gemma else [])
        + (["<start_of_turn>"] if gemma else []))
    fast.chat_template = chat_template
    fast.save_pretrained(str(path))
    if llama3:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [words.index("<|eot_id|>"),
                                                                                  words.index("<|eom_id|>")]}))


def write_model(path: Path, *, vocab_size: int = 128, max_seq_len: int = 256, tokenizer: bool = True,
                seed: int = 0) -> Path:
    """A randomly initialised one-layer Qwen2-shaped model directory."""
    cfg = ModelConfig(vocab_size=vocab_size, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                      max_seq_len=max_seq_len, attention_bias=True)
    _, params = init_params(cfg, seed)
    save_hf_model(path, cfg, params)
    if tokenizer:
        write_char_tokenizer(path)
    return path


# Parity helpers shared by the tests that run transformers' own models (the Reverb lane's torch).


def save_random_hf_model(config, path: Path, seed: int = 0):
    """transformers' model of `config` in float32, its random weights widened (+ 0.1 N(0, 1) each, so
    that no logit ties), saved at `path`; returns the torch model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(str(path))
    return model


def hf_logits(model, tokens):
    """transformers' float logits [B, T, V] of int tokens [B, T] (numpy in, numpy out)."""
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.numpy()


def hf_greedy(model, prompts, n: int, tok):
    """transformers' `generate` greedy continuation [B, n] of full-length prompts, padded with the
    tokenizer's pad id after a row stops (HF stops once all rows end)."""
    import numpy as np
    import torch

    with torch.no_grad():
        out = model.generate(torch.from_numpy(prompts).long(), attention_mask=torch.ones(prompts.shape, dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=list(tok.eos_ids),
                             pad_token_id=tok.pad_id)
    ref = out[:, prompts.shape[1]:].numpy()
    return np.pad(ref, ((0, 0), (0, n - ref.shape[1])), constant_values=tok.pad_id)


def flat_params(params):
    """Sorted (path of strings, numpy array) pairs of an nnx params state: two loads compared leaf by leaf."""
    import numpy as np
    from flax import nnx

    from jaxreplay.compat import value_of

    return sorted(((tuple(map(str, p)), np.asarray(value_of(v))) for p, v in nnx.to_flat_state(params)),
                  key=lambda item: item[0])


def engine_greedy(graphdef, cfg, params, prompts, n: int, tok):
    """The rollout engine's greedy completions [B, n] of `prompts` [B, P], one slot per prompt."""
    import jax
    import numpy as np

    from jaxreplay.rollout.engine import JaxEngine, PromptGroup

    engine = JaxEngine(graphdef, cfg, params, slots=len(prompts), group_size=1, prompt_len=prompts.shape[1],
                       max_new_tokens=n, greedy=True, stop_ids=tok.eos_ids, pad_id=tok.pad_id, chunk_steps=4)
    mask = np.ones(prompts.shape[1], bool)
    engine.submit([PromptGroup(i, prompts[i], mask, jax.random.key(i)) for i in range(len(prompts))])
    done = {}
    while engine.pending():
        engine.step()
        done.update((c.tag, c.rollout) for c in engine.collect())
    return np.concatenate([done[i].tokens[:, prompts.shape[1]:] for i in range(len(prompts))])
