"""Tiny Hugging Face model directories made here (no hub): weights from our own exporter and a
character-level tokenizer with a ChatML chat template."""

from pathlib import Path

from jaxreplay.config import ModelConfig
from jaxreplay.models.hf import save_hf_model
from jaxreplay.models.transformer import init_params

WORDS = ["<pad>", "<s>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(32, 127)] + ["\n"]


def write_char_tokenizer(path: Path) -> None:
    """101 ids; EOS = <|im_end|>; `{% if add_generation_prompt %}` opens the assistant turn."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers

    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    fast.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(str(path))


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
