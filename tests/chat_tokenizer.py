"""Tiny Hugging Face tokenizers with a chat template, built in the test (no model hub): a word-level one,
and a byte-level one that any text encodes with (one token per byte, no merges).

The byte-level one is a `Qwen2Tokenizer` because transformers 5 loads every folder whose config.json
says `model_type: qwen2` with that class, whatever tokenizer_config.json declares, rebuilding it from
the vocabulary with Qwen2's own pre-tokenizer: a word-level vocabulary loaded that way encodes most
text to nothing. A byte vocabulary reads the same under Qwen2's pipeline and under its own.
"""

from __future__ import annotations

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_chat_tokenizer(folder, vocab_size: int, chat_template: str | None = TEMPLATE):
    """Save a tokenizer of exactly `vocab_size` ids (specials, then words w0, w1, ...) to `folder`:
    ids 0, 1, 2 are pad, bos, eos as in the tiny test models; "<|end|>" (id 7) ends a turn."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + [f"w{i}" for i in range(vocab_size - len(SPECIALS))]
    core = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>",
                                        additional_special_tokens=SPECIALS[4:])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer


BYTE_VOCAB = len(SPECIALS) + 256


def build_byte_tokenizer(folder, chat_template: str | None = TEMPLATE):
    """Save a byte-level tokenizer of `BYTE_VOCAB` ids (the specials as above, then the 256 bytes) to
    `folder`; it loads back right beside any Llama, Qwen2 or Qwen3 config.json."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {token: i for i, token in enumerate(SPECIALS + list(bytes_to_unicode().values()))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                               pad_token="<pad>", additional_special_tokens=SPECIALS[4:])
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)
    return tokenizer
