"""Tokenizers rebuilt from GGUF metadata.

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary, scores, token types and merges
as metadata under `tokenizer.ggml.*`. This module reads those keys and builds the equivalent
`tokenizers.Tokenizer`, shaped like the one transformers' GGUF integration builds, so both split
text into the same ids:

- `tokenizer.ggml.model == "llama"`: SentencePiece BPE with byte fallback (`<0xNN>` tokens, `▁` for
  spaces). Merges are recovered from the vocabulary, best score first. Gemma files get Gemma's
  shape: spaces become `▁` in a normalizer (no prefix space), merges follow vocabulary order.
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the file's merges, splitting text with the
  regexes llama.cpp applies for `tokenizer.ggml.pre`. NOTE: for the names outside its short table
  (deepseek-v3, falcon, starcoder, ...) transformers splits like GPT-2; tokenmill follows llama.cpp.

Control tokens (type 3) become special added tokens and user-defined ones (type 4) plain added
tokens, so text like "<start_of_turn>" is matched whole instead of being cut into pieces.

Metadata comes from tokenmill/modelfile.py's header reader (not `gguf.GGUFReader`, ~100x slower on
a 262k-token vocabulary).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from tokenmill.memory import release_freed_memory
from tokenmill.modelfile import read_gguf
from tokenmill.store import cache_dir, evict_lru, write_atomic

logger = logging.getLogger(__name__)

# llama.cpp's `llama_token_type` values stored in tokenizer.ggml.token_type.
_TOKEN_TYPE_UNKNOWN = 2
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# Split regexes for byte-level vocabularies, keyed by tokenizer.ggml.pre: every name llama.cpp
# knows, with the regexes its BPE pre-tokenizer applies in turn (src/llama-vocab.cpp: the names in
# `llama_vocab::impl::load`, the regexes in `llm_tokenizer_bpe`; the `LLAMA_VOCAB_PRE_TYPE_*` of
# each group is in its comment). Each regex splits every piece the one before it left, keeping both
# its matches and the text between them (tokenizers' "isolated"); then bytes become the GPT-2
# alphabet. The HF model each name was hashed from is in llama.cpp's convert_hf_to_gguf_update.py.
# NOTE: where llama.cpp runs a rewrite of the model's tokenizer.json regex that its std::regex can
# digest ("(?:'[sS]|..." for "(?i:'s|...", lookahead tricks standing in for \p{Lu} and \p{Ll},
# greedy for possessive quantifiers) and cites the original, the original is written here. Where it
# runs a hand-written C++ splitter (kimi-k2, afmoe's digits), the regex that splitter implements.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# fmt: off
_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    # DEFAULT (also what llama.cpp uses when a file has no tokenizer.ggml.pre): Falcon's split.
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    # GPT2, MPT, OLMO, JAIS, TRILLION, GRANITE_DOCLING ("gpt2" is tokenmill's own alias)
    **dict.fromkeys(
        (
            "gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
            "a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe",
            "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling",
        ),
        (_GPT2,),
    ),
    # LLAMA3, DBRX, SMAUG, CHATGLM4
    **dict.fromkeys(
        (
            "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
            "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4", "glm5",
        ),
        (_LLAMA3,),
    ),
    # JAIS2: llama3's, with whitespace runs cut at powers of two
    "jais-2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)"
        r"|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    # QWEN2, STABLELM2, HUNYUAN, SOLAR_OPEN, GROK_2
    **dict.fromkeys(
        (
            "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
            "solar-open", "grok-2",
        ),
        (_QWEN2,),
    ),
    # QWEN35: qwen2's, with combining marks kept on their letters
    "qwen35": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # UFAKZEKA: qwen2's without the English contractions
    "ufakzeka": (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # LAGUNA: lines first, then qwen2's
    "laguna": (r"[^\n]+|[\n]+", _QWEN2),
    # MINICPM5
    "minicpm5": (
        r"\p{N}{1,3}",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # SEED_CODER
    "seed-coder": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
        r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # BAILINGMOE
    **dict.fromkeys(
        ("bailingmoe", "bailingmoe2", "llada-moe"),
        (
            r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}"
            r"| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
    ),
    # EXAONE_MOE
    "exaone-moe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    # STARCODER, REFACT, COMMAND_R, SMOLLM, CODESHELL, EXAONE, MINERVA, MELLUM2: digits one by one
    **dict.fromkeys(
        (
            "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
            "mellum2",
        ),
        (r"\p{N}", _GPT2),
    ),
    # FALCON
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    # CHAMELEON: its special-token shapes, whitespace, digits and punctuation, then GPT-2's
    "chameleon": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ),
    # DEEPSEEK_LLM
    # NOTE: letters that Unicode normalization would rewrite (U+1F7D to U+03CE, U+212A to "K",
    # ...) are escaped, so an editor cannot silently turn a range inside out.
    "deepseek-llm": (
        r"[\r\n]",
        r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-Ρ"
        r"Σ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕ"
        r"ἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌ"
        r"ῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ"
        r"\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇ"
        r"Ꞌ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        r"\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
        r"\s+$",
        r"[一-龥\u0800-一가-\ud7ff]+",
        r"\p{N}+",
    ),
    # DEEPSEEK_CODER
    "deepseek-coder": (
        r"[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        r"[一-龥\u0800-一가-\ud7ff]+",
        r"\p{N}",
    ),
    # DEEPSEEK3_LLM, HUNYUAN_DENSE, JOYAI_LLM, HY_V4
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3),
    # SPARK2_5
    "spark2_5": (
        r"\p{N}{1,3}",
        r"[一-龥\u3040-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}",
    ),
    # YOUTU
    "youtu": (
        r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # AFMOE: digit runs cut in threes from the right, CJK and other Asian scripts, then words
    # NOTE: llama.cpp's source has U+8C48 for this class's U+F900, what Unicode normalization
    # makes of it; the range would then take in Yi, Cyrillic and Latin extensions and more.
    "afmoe": (
        r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
        r"[\u4e00-\u9fff\u3400-\u4dbf\uf900-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
        r"\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
        r"\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # PORO, BLOOM, GPT3_FINNISH
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), (_BLOOM,)),
    # VIKING
    "viking": (_BLOOM, r"\p{N}"),
    # TEKKEN (Mistral Nemo, Pixtral 12B): gpt-4o's words, without contractions, digits one by one
    "tekken": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # GPT4O, MINIMAX_M2
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O,)),
    # TINY_AYA: digit runs cut in threes from the right, then gpt-4o's
    **dict.fromkeys(("tiny_aya", "cohere2moe"), (r"\d{1,3}(?=(?:\d{3})*\b)", _GPT4O)),
    # GRANITE_EMB_MULTI: llama.cpp cites no original; this is its lookahead form of gpt-4o's
    "granite-embed-multi-97m": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+"
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
        r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*"
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # KIMI_K2: Han runs on their own, gpt-4o-like words without Han
    "kimi-k2": (
        r"[\p{Han}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    # SUPERBPE: digit runs, then cut in threes from the right
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
}
# fmt: on
# Names llama.cpp knows whose BPE runs on raw UTF-8 (SentencePiece-style "▁" spaces or plain
# whitespace words), not on GPT-2's byte alphabet: GEMMA4, SARVAM_MOE, WHITESPACE.
_RAW_UTF8_PRE_NAMES = ("gemma4", "granite-embed-multi-311m", "sarvam-moe", "whitespace")
# An unknown name falls back to the first entry whose hint it contains, else to GPT-2's split.
_PRE_FALLBACKS = (("llama", "llama-bpe"), ("qwen", "qwen2"), ("deepseek", "deepseek-v3"))


@dataclass(frozen=True, slots=True)
class GGUFTokenizerSpec:
    """Everything a GGUF file says about its tokenizer.

    Attributes:
        backend: the rebuilt tokenizer, without a post-processor (BOS/EOS are the caller's job).
        architecture: `general.architecture`, e.g. "gemma3", if the file states it.
        add_bos / add_eos: whether plain-text encoding should add BOS / EOS.
        chat_template: `tokenizer.chat_template`, if the file carries one.
    """

    backend: BackendTokenizer
    architecture: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    unk_token_id: int | None
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def read_gguf_metadata(
    path: str | Path, prefixes: Iterable[str] = ("general.", "tokenizer.")
) -> dict[str, Any]:
    """The metadata key/values of a GGUF file whose key starts with one of ``prefixes``
    (tokenmill/modelfile.py reads the header; tensor data is not touched)."""
    return read_gguf(path, prefixes).metadata


def load_gguf_tokenizer_spec(path: str | Path) -> GGUFTokenizerSpec:
    """Reads a GGUF file's tokenizer metadata and rebuilds its tokenizer."""
    metadata = read_gguf_metadata(path)
    spec = build_gguf_tokenizer_spec(metadata)
    del metadata
    release_freed_memory()
    return spec


def build_gguf_tokenizer_spec(metadata: dict[str, Any]) -> GGUFTokenizerSpec:
    """Builds the tokenizer described by GGUF metadata (as `read_gguf_metadata` returns it)."""
    model = metadata.get("tokenizer.ggml.model")
    tokens: list[str] | None = metadata.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ValueError("GGUF file has no tokenizer (no tokenizer.ggml.tokens)")
    architecture = metadata.get("general.architecture")
    token_types = metadata.get("tokenizer.ggml.token_type") or []
    if model in ("llama", "gemma4"):
        # "gemma4": Gemma 4's BPE as llama.cpp reads it, Gemma's SentencePiece-style pieces over
        # raw UTF-8 ("▁" for spaces, no prefix space, the file's merges, byte fallback).
        backend = _build_sentencepiece(
            tokens,
            scores=metadata.get("tokenizer.ggml.scores"),
            file_merges=metadata.get("tokenizer.ggml.merges"),
            is_gemma=model == "gemma4" or str(architecture).startswith("gemma"),
            add_space_prefix=model == "llama"
            and metadata.get("tokenizer.ggml.add_space_prefix", True),
            unk_token_id=metadata.get("tokenizer.ggml.unknown_token_id"),
        )
        # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (and to
        # Gemma 4's whatever it says).
        default_add_bos = True
    elif model == "gpt2":
        if "tokenizer.ggml.merges" not in metadata:
            raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
        backend = _build_byte_level(
            tokens, metadata["tokenizer.ggml.merges"], metadata.get("tokenizer.ggml.pre")
        )
        default_add_bos = False
    else:
        raise ValueError(
            f"Unsupported GGUF tokenizer model {model!r}; supported: 'llama' (SentencePiece), "
            "'gemma4' (Gemma 4's SentencePiece-style BPE), 'gpt2' (byte-level BPE)"
        )
    _add_marked_tokens(backend, tokens, token_types, byte_level=model == "gpt2")
    # BOS/EOS/UNK/PAD are special whatever their token type says (transformers does the same).
    special_ids = [
        metadata.get(f"tokenizer.ggml.{name}")
        for name in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
    ]
    backend.add_special_tokens(
        [
            AddedToken(tokens[token_id], normalized=False, special=True)
            for token_id in special_ids
            if token_id is not None
            and 0 <= token_id < len(tokens)
            and backend.token_to_id(tokens[token_id]) is not None  # never grow the vocabulary
        ]
    )
    if len(set(tokens)) != len(tokens):
        logger.warning("GGUF vocabulary repeats token strings; later ids shadow earlier ones")
    return GGUFTokenizerSpec(
        backend=backend,
        architecture=architecture,
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=metadata.get("tokenizer.ggml.padding_token_id"),
        unk_token_id=metadata.get("tokenizer.ggml.unknown_token_id"),
        add_bos=model == "gemma4"
        or bool(metadata.get("tokenizer.ggml.add_bos_token", default_add_bos)),
        add_eos=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=metadata.get("tokenizer.chat_template"),
    )


def _build_sentencepiece(
    tokens: list[str],
    *,
    scores: Sequence[float] | None,
    file_merges: Sequence[str] | None,
    is_gemma: bool,
    add_space_prefix: bool,
    unk_token_id: int | None,
) -> BackendTokenizer:
    """SentencePiece BPE over the file's pieces, with byte fallback."""
    if is_gemma:
        # Gemma files store the whitespace-run pieces ("  ", "   ", ...) with real spaces, while
        # the text side spells spaces as "▁"; respell them so they can be produced and merged.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        # Gemma's merge order is its vocabulary order; its scores do not all follow it.
        scores = [-float(idx) for idx in range(len(tokens))]
    vocab = {token: idx for idx, token in enumerate(tokens)}
    if file_merges is not None:
        merges = [tuple(merge.split(" ", 1)) for merge in file_merges]
    else:
        if scores is None:
            raise ValueError("GGUF SentencePiece tokenizer has neither merges nor scores")
        merges = _cached_merges(tokens, vocab, scores)
    unk_token = tokens[unk_token_id] if unk_token_id is not None else None
    backend = BackendTokenizer(
        BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    decoder_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if is_gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        # NOTE: a no-op after the normalizer, kept because Gemma's own tokenizer.json has it.
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        # "first": the prefix space goes on the text's first piece only, not after each special
        # token (transformers' non-legacy Llama behaviour).
        prepend_scheme = "first" if add_space_prefix else "never"
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme=prepend_scheme, split=False
        )
        if add_space_prefix:
            decoder_steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(decoder_steps)
    return backend


# Smaller vocabularies' merges take well under 0.1 s: not worth an entry.
MIN_CACHED_VOCAB = 32768
MAX_CACHED_MERGES = 8  # entries kept, the most recently used


def _cached_merges(
    tokens: list[str], vocab: dict[str, int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """``_merges_from_scores``, remembered on disk by a hash of its inputs and of this module's
    source (so a change to the rule is a new entry): ~0.7 s for Gemma's 262k pieces, ~0.1 s read
    back. The entry holds each merge's two vocabulary ids as int32; one that does not fit the
    vocabulary is computed afresh (and rewritten). Vocabularies under MIN_CACHED_VOCAB, or
    TOKENMILL_NO_CACHE=1, skip the cache."""
    directory = cache_dir("tokenizers")
    if directory is None or len(tokens) < MIN_CACHED_VOCAB:
        return _merges_from_scores(tokens, vocab, scores)
    digest = hashlib.blake2b(Path(__file__).read_bytes(), digest_size=16)
    digest.update(array("q", map(len, tokens)).tobytes())  # the boundaries between tokens
    digest.update("".join(tokens).encode("utf-8", "surrogatepass"))
    digest.update(array("d", scores).tobytes())
    path = directory / f"merges-{digest.hexdigest()}.bin"
    with contextlib.suppress(OSError, ValueError):  # absent, or not whole int32s
        ids = array("i")
        ids.frombytes(path.read_bytes())
        if len(ids) % 2 == 0 and (not ids or 0 <= min(ids) <= max(ids) < len(tokens)):
            os.utime(path)  # most recently used: the last one evicted
            return list(zip(map(tokens.__getitem__, ids[0::2]), map(tokens.__getitem__, ids[1::2])))
    merges = _merges_from_scores(tokens, vocab, scores)
    ids = array("i", (vocab[part] for merge in merges for part in merge))
    with contextlib.suppress(OSError):  # a read-only cache costs the computation next time
        write_atomic(path, lambda tmp: tmp.write_bytes(ids.tobytes()))
        evict_lru(directory, "merges-*.bin", MAX_CACHED_MERGES)
    return merges


def _merges_from_scores(
    tokens: list[str], vocab: dict[str, int], scores: Sequence[float]
) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a piece into two pieces.

    Ranked by the merged piece's score (best first), then longer left part, then longer right
    part, then vocabulary order: the order of transformers' `generate_merges`, so ties break alike.
    """
    score_by_token = dict(zip(tokens, scores))  # later duplicates win, as in a dict-built vocab
    ordered_scores = list(score_by_token.values())
    if all(a > b for a, b in zip(ordered_scores, ordered_scores[1:])):
        # Fast path (Gemma, ~1 s for 262k pieces): strictly decreasing scores make the ranking the
        # iteration order, longest left part first, so nothing needs sorting.
        return [
            (piece[:split_idx], piece[split_idx:])
            for piece in score_by_token
            for split_idx in range(len(piece) - 1, 0, -1)
            if piece[:split_idx] in vocab and piece[split_idx:] in vocab
        ]
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for order, (piece, score) in enumerate(score_by_token.items()):
        piece_len = len(piece)
        for split_idx in range(1, piece_len):
            left = piece[:split_idx]
            if left in vocab:
                right = piece[split_idx:]
                if right in vocab:
                    ranked.append((-score, -split_idx, split_idx - piece_len, order, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map used to spell byte-level vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _build_byte_level(
    tokens: list[str], merges: Sequence[str], pre: str | None
) -> BackendTokenizer:
    """Byte-level BPE over the file's vocabulary and merges."""
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    # Tokens are stored byte-level spelled already, except a few added ones written as plain text.
    vocab = {
        (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): idx
        for idx, t in enumerate(tokens)
    }
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(
        BPE(vocab, pairs, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *(
                pre_tokenizers.Split(Regex(split), behavior="isolated")
                for split in _pre_tokenizer_splits(pre)
            ),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _pre_tokenizer_splits(pre: str | None) -> tuple[str, ...]:
    """The split regexes for a tokenizer.ggml.pre value; an unknown one gets the closest known."""
    if not pre:
        # llama.cpp does the same (and warns that generation quality will suffer).
        logger.warning(
            "GGUF file has no tokenizer.ggml.pre; splitting text like llama.cpp's 'default'"
        )
        return _PRE_TOKENIZER_SPLITS["default"]
    if pre in _PRE_TOKENIZER_SPLITS:
        return _PRE_TOKENIZER_SPLITS[pre]
    if pre in _RAW_UTF8_PRE_NAMES:
        raise ValueError(
            f"GGUF tokenizer.ggml.pre {pre!r} is a BPE over raw UTF-8 text in llama.cpp, not over "
            "GPT-2's byte alphabet; tokenmill does not rebuild it"
        )
    fallback = next((name for hint, name in _PRE_FALLBACKS if hint in pre.lower()), "gpt-2")
    logger.warning("Unknown tokenizer.ggml.pre %r; splitting text like %r instead", pre, fallback)
    return _PRE_TOKENIZER_SPLITS[fallback]


def _add_marked_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: Sequence[int], *, byte_level: bool
) -> None:
    """Registers unknown/control tokens as special and user-defined ones as plain added tokens."""
    alphabet = set(byte_alphabet().values()) if byte_level else None
    special = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types)
        # NOTE: in a byte-level vocabulary a "control" token spelled outside the byte alphabet is
        # a converter mislabel; adding it would grow the vocabulary past the model's size.
        if token_type in (_TOKEN_TYPE_UNKNOWN, _TOKEN_TYPE_CONTROL)
        and (alphabet is None or set(token) <= alphabet)
    ]
    if special:
        backend.add_special_tokens(special)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == _TOKEN_TYPE_USER_DEFINED and backend.token_to_id(token) is not None
    ]
    if user_defined:
        backend.add_tokens(user_defined)
