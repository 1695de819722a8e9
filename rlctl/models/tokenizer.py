"""The embedded character-level tokenizer and tokenizer hashing.

What this is: a Hugging Face fast tokenizer built locally with ``tokenizers``
(one id per printable ASCII character plus pad/bos/eos/unk), saved and
reloaded like any HF tokenizer; and ``tokenizer_hash`` for any tokenizer dir.

What this is not: a trained BPE. Real models bring their own tokenizer.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
CHARS = [chr(c) for c in range(32, 127)]


def build_char_tokenizer() -> Any:
    """A fresh character-level ``PreTrainedTokenizerFast``: one id per printable ASCII char, left padding."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", padding_side="left",
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def tokenizer_hash(model_dir: str | Path) -> str:
    """sha256 over the tokenizer files present in ``model_dir`` (name + bytes)."""
    h = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = Path(model_dir) / name
        if path.is_file():
            found = True
            h.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    if not found:
        return "none"
    return h.hexdigest()[:16]
