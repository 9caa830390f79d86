"""A character-level tokenizer with the slice of the Hugging Face tokenizer interface tlt uses.

Ids are fixed and deterministic: the special tokens `<pad>`=0, `<bos>`=1, `<eos>`=2, then one id per
character in a fixed order (by default `0123456789+-*=;#QA: \\n`, enough for the arithmetic task).
Code that tokenizes, decodes, pads and saves checkpoints is written once against this interface and
runs unchanged with a tiny test model (this tokenizer) or a real checkpoint (an HF tokenizer):
`encode`/`decode`/`batch_decode`/`__call__`, the `*_token` and `*_token_id` attributes,
`convert_tokens_to_ids`/`convert_ids_to_tokens`, `save_pretrained`/`from_pretrained`.

`encode` prepends `<bos>` when `add_special_tokens`, like Llama tokenizers, and never appends `<eos>`:
the generator emits that. There is no unknown token: a character outside the vocabulary is an error,
so a prompt the model cannot see is caught where it is built, not after training on `<unk>`.

On disk the tokenizer is one file, `char_tokenizer.json`, holding the vocabulary (token -> id) and
the special tokens; it is written to a temporary file and renamed, so a crash never leaves half a file.
"""

from __future__ import annotations

import json
import operator
import os
from pathlib import Path

from tlt.io import atomic_write_bytes
from typing import Iterable

DEFAULT_CHARACTERS = "0123456789+-*=;#QA: \n"
FILENAME = "char_tokenizer.json"
FORMAT = "tlt.CharTokenizer"


class CharTokenizer:
    """Maps each character to one id, after the three special tokens."""

    pad_token = "<pad>"
    bos_token = "<bos>"
    eos_token = "<eos>"
    pad_token_id = 0
    bos_token_id = 1
    eos_token_id = 2
    special_tokens = (pad_token, bos_token, eos_token)

    def __init__(self, characters: str = DEFAULT_CHARACTERS) -> None:
        if not isinstance(characters, str) or not characters:
            raise ValueError(f"characters must be a non-empty string, got {characters!r}")
        repeated = sorted({c for c in characters if characters.count(c) > 1})
        if repeated:
            raise ValueError(f"characters must be unique, repeated: {repeated!r}")
        self.characters = characters
        self._id_to_token = self.special_tokens + tuple(characters)
        self._token_to_id = {token: i for i, token in enumerate(self._id_to_token)}

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_token)

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Ids of the characters of `text`, after `<bos>` when `add_special_tokens`."""
        ids = [self.bos_token_id] if add_special_tokens else []
        for position, char in enumerate(text):
            # Special tokens are multi-character names, so a single character never hits one.
            token_id = self._token_to_id.get(char)
            if token_id is None:
                raise ValueError(
                    f"character {char!r} at position {position} of the text is not in the vocabulary"
                )
            ids.append(token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of a 1-D sequence of ids (list, tuple, 1-D tensor or array); special tokens and ids past
        the vocabulary (a model's padded embedding rows) are dropped when `skip_special_tokens`, else
        written by name (`<eos>`, `<unused:30>`)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            raise ValueError("decode expects a 1-D sequence of ids, got a single id")
        pieces = []
        for item in ids:
            if isinstance(item, (list, tuple)):
                raise ValueError("decode expects a 1-D sequence of ids; use batch_decode for a batch")
            if operator.index(item) >= self.vocab_size:
                # Models pad their embedding past the tokenizer's vocabulary; a sampled padding id is
                # not text. It is shown only when special tokens are.
                if not skip_special_tokens:
                    pieces.append(f"<unused:{item}>")
                continue
            token = self.convert_ids_to_tokens(item)
            if not (skip_special_tokens and token in self.special_tokens):
                pieces.append(token)
        return "".join(pieces)

    def batch_decode(
        self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        """`decode` of each sequence of a batch (list of lists or a 2-D tensor)."""
        if hasattr(sequences, "tolist"):
            sequences = sequences.tolist()
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in sequences]

    def __call__(
        self, text: str | list[str], add_special_tokens: bool = True
    ) -> dict[str, list[int] | list[list[int]]]:
        """`{"input_ids", "attention_mask"}` for one text (lists) or a list of texts (lists of
        lists), unpadded, as an HF tokenizer returns them."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if isinstance(text, (list, tuple)) and all(isinstance(t, str) for t in text):
            batch = [self.encode(t, add_special_tokens) for t in text]
            return {"input_ids": batch, "attention_mask": [[1] * len(ids) for ids in batch]}
        raise TypeError(f"expected a string or a list of strings, got {type(text).__name__}")

    def convert_tokens_to_ids(self, token: str) -> int:
        """Id of one token: a vocabulary character or a special token name."""
        token_id = self._token_to_id.get(token)
        if token_id is None:
            raise ValueError(f"token {token!r} is not in the vocabulary")
        return token_id

    def convert_ids_to_tokens(self, token_id: int) -> str:
        """Token (character or special token name) of one id."""
        index = operator.index(token_id)
        if not 0 <= index < self.vocab_size:
            raise ValueError(f"token id {index} is out of range 0..{self.vocab_size - 1}")
        return self._id_to_token[index]

    def to_transformers(self):
        """The same tokenizer as a transformers `PreTrainedTokenizerFast` (same ids, `<bos>` prepended
        when special tokens are added, special tokens dropped on decode when asked), for libraries
        that need one, such as TRL. A transformers tokenizer cannot refuse a character outside the
        vocabulary as `encode` does: it maps it to `<pad>`, so check text with `encode` first."""
        from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
        from transformers import PreTrainedTokenizerFast

        core = Tokenizer(models.WordLevel(dict(self._token_to_id), unk_token=self.pad_token))
        core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
        core.decoder = decoders.Fuse()
        core.post_processor = processors.TemplateProcessing(
            single=f"{self.bos_token} $A", pair=f"{self.bos_token} $A {self.bos_token} $B",
            special_tokens=[(self.bos_token, self.bos_token_id)])
        return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=self.bos_token, eos_token=self.eos_token,
                                       pad_token=self.pad_token)

    @classmethod
    def _special_tokens_map(cls) -> dict[str, str]:
        return {"pad_token": cls.pad_token, "bos_token": cls.bos_token, "eos_token": cls.eos_token}

    def save_pretrained(self, directory: str | os.PathLike[str]) -> Path:
        """Write `char_tokenizer.json` into `directory` (created if needed); returns its path."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / FILENAME
        state = {"format": FORMAT, "special_tokens": self._special_tokens_map(), "vocab": self._token_to_id}
        atomic_write_bytes(path, json.dumps(state, indent=1, ensure_ascii=True).encode("utf-8"))
        return path

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str]) -> CharTokenizer:
        """The tokenizer saved by `save_pretrained` in `directory`."""
        path = Path(directory) / FILENAME
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer file at {path}")
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"corrupt tokenizer file {path}: {e}") from e
        if not isinstance(state, dict) or state.get("format") != FORMAT:
            raise ValueError(f"{path} is not a {FORMAT} file")
        if state.get("special_tokens") != cls._special_tokens_map():
            raise ValueError(f"{path}: special tokens must be {cls._special_tokens_map()}")
        vocab = state.get("vocab")
        if (
            not isinstance(vocab, dict)
            or not all(type(i) is int for i in vocab.values())
            or sorted(vocab.values()) != list(range(len(vocab)))
        ):
            raise ValueError(f"{path}: vocab must map tokens to the ids 0..n-1")
        tokens = sorted(vocab, key=vocab.__getitem__)
        n_special = len(cls.special_tokens)
        if tuple(tokens[:n_special]) != cls.special_tokens:
            raise ValueError(
                f"{path}: ids 0..{n_special - 1} must be the special tokens {cls.special_tokens}"
            )
        characters = tokens[n_special:]
        if any(len(c) != 1 for c in characters):
            raise ValueError(f"{path}: every non-special token must be a single character")
        return cls("".join(characters))
