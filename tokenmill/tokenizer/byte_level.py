"""A byte-level tokenizer for models with random weights (the tests' tiny models, benchmarks'
synthetic ones): every byte is a token, with no merges, so any text round-trips."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path


def write_byte_tokenizer(
    model_dir: Path,
    vocab_size: int,
    added_tokens: Sequence[str] = (),
    chat_template: str | None = None,
    eos_token: str = "</s>",
    special_tokens: Sequence[str] = (),
) -> None:
    """tokenizer.json and tokenizer_config.json in ``model_dir``: a byte-level BPE without
    merges, <pad> <s> </s> as ids 0-2 (bos <s>, eos </s>) and the 256 bytes as ids 3-258, for a
    model of ``vocab_size`` >= 259; ``added_tokens`` from id 259 on, each one token (as a chat
    format's <|im_end|> or <think> are; those in ``special_tokens`` special, dropped from
    decoded text as <|im_end|> is), with ``chat_template`` and ``eos_token`` in the config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    for text in added_tokens:
        vocab[text] = len(vocab)
    if len(vocab) > vocab_size:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {len(vocab)}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    plain = [t for t in added_tokens if t not in special_tokens]
    if plain:  # not special: their text stays in decoded outputs, as <think> does
        tok.add_tokens(plain)
    tok.add_special_tokens([t for t in added_tokens if t in special_tokens])
    tok.save(str(model_dir / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": eos_token, "add_bos_token": True}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
