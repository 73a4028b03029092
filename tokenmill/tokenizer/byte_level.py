"""A byte-level tokenizer for models with random weights (the tests' tiny models, benchmarks'
synthetic ones): every byte is a token, with no merges, so any text round-trips."""

from __future__ import annotations

import json
from pathlib import Path


def write_byte_tokenizer(model_dir: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json in ``model_dir``: a byte-level BPE without
    merges, <pad> <s> </s> as ids 0-2 (bos <s>, eos </s>) and the 256 bytes as ids 3-258, for a
    model of ``vocab_size`` >= 259."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    if len(vocab) > vocab_size:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {len(vocab)}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<pad>", "<s>", "</s>"])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    )
