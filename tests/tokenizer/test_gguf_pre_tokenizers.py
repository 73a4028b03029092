"""Every tokenizer.ggml.pre llama.cpp knows rebuilds to the pre-tokenizer llama.cpp runs for it.

Each test writes a tiny byte-level GGUF (the 256 GPT-2 alphabet tokens plus merges learned on
SAMPLES with no pre-split, so a piece boundary in the wrong place changes the ids) with
`tokenizer.ggml.model = "gpt2"` and the name under test, loads it, and compares the pieces
(`backend.pre_tokenizer.pre_tokenize_str`) and the ids on SAMPLES with an oracle:

- every name: llama.cpp's own regexes (REFERENCE_SPLITS, copied from src/llama-vocab.cpp of the
  llama.cpp that llama-cpp-python 0.3.36 vendors), run by the `regex` package one after another,
  each splitting the pieces the one before left, as llama.cpp's `unicode_regex_split` does; then
  GPT-2's byte alphabet and a BPE written out below. This is the only oracle for the names
  transformers does not honour: its GGUF loader ignores tokenizer.ggml.pre outside a short table
  and splits like GPT-2 (e.g. deepseek-v3, falcon, starcoder, chameleon, kimi-k2, ...). It is also
  run on the names transformers does honour, as a second check.
- TRANSFORMERS_NAMES (the names in transformers' `GGUF_PRE_TOKENIZER_SPLITS`: the llama3, qwen2,
  qwen35, tekken and gpt-4o families), plus GPT-2's own family (transformers' fallback split is
  GPT-2's): transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).

REFERENCE_SPLITS keeps llama.cpp's own spelling ("(?:'[sS]|..." where tokenmill writes the
tokenizer.json original "(?i:'s|..."), so those rewrites are checked to split alike. It departs from
what llama.cpp's code runs in four places:
- TEKKEN, GPT4O, MINIMAX_M2 and TINY_AYA's second regex: the tokenizer.json original llama.cpp
  cites. Its rewrite ("((?=[\\p{L}])([^a-z]))*" for upper-case letters) only means that after its
  own trick of collapsing every non-ASCII letter to one code point; run as a plain regex it would
  not split "ПриветМир" where the model does.
- KIMI_K2 and AFMOE's first regex: llama.cpp runs hand-written C++ splitters there ("\\p{Han}+"
  and "\\p{AFMoE_digits}" only select them); these are the regexes those splitters implement (for
  kimi-k2 the one quoted above `unicode_regex_split_custom_kimi_k2` in src/unicode.cpp).
- AFMOE's second regex starts its third range at U+F900 (CJK Compatibility Ideographs), where
  llama.cpp's source has U+8C48, the character U+F900 becomes under Unicode normalization: the
  range would otherwise run on over Yi, Cyrillic and Latin extensions and the private use area.
- GEMMA4, SARVAM_MOE and WHITESPACE are left out: their BPE runs on raw UTF-8 rather than GPT-2's
  byte alphabet, which a byte-level rebuild cannot express (loading such a file raises).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import regex
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers, trainers
from tokenizers.models import BPE

from tokenmill.tokenizer.gguf import load_gguf_tokenizer_spec

SAMPLES = [
    "Hello World! I don't know; they'RE here, she'dn't, we'll see HTTPServer's camelCase IDs.\n",
    "Digits 1234567 and 12, 3.14159, -42, a1234567b x12 ١٢٣٤٥ ½ and 0000000000.\n",
    "   leading  spaces, two\n\n\nnewlines\r\nwindows\ttab\t\ttabs" + " " * 20 + "wide   \n",
    "中文字符和日本語のひらがな、カタカナ。漢字123한국어 문장입니다.\n",
    "Москва — столица России. ПриветМир Ёлка! Ünïcödé ÀÉÎ naïve façade.\n",
    "مرحبا بالعالم، هذه جملة عربية. नमस्ते दुनिया। combining e\u0301 and n\u0303o.\n",
    "Emoji 😀🎉👍🏽 👩\u200d👩\u200d👧 ★☆ ™ © → ∑√ 🇩🇪  \n",
    "def f(x):\n    return {'a': [x**2, x // 3]}  # $+<=>^`|~ @#%&* \"q\" /path/to\n",
    "<sentinel:12> IMGIMGABCZ \u3000ideographic\u00a0nbsp…。，、।۔، ！？ end   ",
]

# fmt: off
# Copied from llama.cpp's src/llama-vocab.cpp (see the module docstring for the four departures).
REFERENCE_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("LLAMA3", "DBRX", "SMAUG", "CHATGLM4"),
        (
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
    ),
    "JAIS2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    "DEEPSEEK_LLM": (
        r"[\r\n]",
        r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1f7dᾀ-ᾴᾶ-ᾼ\u1fbeῂ-ῄῆ-ῌῐ-\u1fd3ῖ-\u1fdbῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212a-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        r"\s?[!-/:-~！-／：-～‘-‟\u3000-。]+",
        r"\s+$",
        r"[一-龥ࠀ-一가-\ud7ff]+",
        r"\p{N}+",
    ),
    **dict.fromkeys(
        ("DEEPSEEK3_LLM", "HUNYUAN_DENSE", "JOYAI_LLM", "HY_V4"),
        (
            r"\p{N}{1,3}",
            r"[一-龥\u3040-ゟ゠-ヿ]+",
            r"[!" '"' r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
    ),
    "SPARK2_5": (
        r"\p{N}{1,3}",
        r"[一-龥\u3040-ゟ゠-ヿ]+",
        r"[!" '"' r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
        r"\p{N}",
    ),
    "YOUTU": (
        r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥\u3040-ゟ゠-ヿ]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "DEEPSEEK_CODER": (
        r"[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        r"[一-龥ࠀ-一가-\ud7ff]+",
        r"\p{N}",
    ),
    "FALCON": (
        r"[\p{P}\$\+<=>\^~\|`]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"[0-9][0-9][0-9]",
    ),
    **dict.fromkeys(
        ("STARCODER", "REFACT", "COMMAND_R", "SMOLLM", "CODESHELL", "EXAONE", "MINERVA", "MELLUM2"),
        (
            r"\p{N}",
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        ),
    ),
    **dict.fromkeys(
        ("GPT2", "MPT", "OLMO", "JAIS", "TRILLION", "GRANITE_DOCLING"),
        (
            r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        ),
    ),
    **dict.fromkeys(
        ("STABLELM2", "QWEN2", "HUNYUAN", "SOLAR_OPEN", "GROK_2"),
        (
            r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
    ),
    "QWEN35": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    **dict.fromkeys(
        ("PORO", "BLOOM", "GPT3_FINNISH"),
        (
            r" ?[^(\s|.,!?…。，、।۔،)]+",
        ),
    ),
    "VIKING": (
        r" ?[^(\s|.,!?…。，、।۔،)]+",
        r"\p{N}",
    ),
    "TEKKEN": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "CHAMELEON": (
        r"<sentinel:[0-9]+>",
        r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    ),
    **dict.fromkeys(
        ("GPT4O", "MINIMAX_M2"),
        (
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
    ),
    "GRANITE_EMB_MULTI": (
        r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "TINY_AYA": (
        r"\d{1,3}(?=(?:\d{3})*\b)",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "KIMI_K2": (
        r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "SUPERBPE": (
        r"\p{N}+",
        r"(?=(\d{3})+(?!\d))",
    ),
    "BAILINGMOE": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "SEED_CODER": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "UFAKZEKA": (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "AFMOE": (
        r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))",
        r"[一-鿿㐀-䶿\uf900-\ufaff\u3040-ゟ゠-ヿ･-ﾟ⼀-\u2fdfเ-\u0e7f\u0e80-\u0effក-\u17ffက-႟ꩠ-ꩿꧠ-\ua9ff가-\ud7afᄀ-ᇿ]+",
        r"[!" '"' r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "LAGUNA": (
        r"[^\n]+|[\n]+",
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "EXAONE_MOE": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "MINICPM5": (
        r"\p{N}{1,3}",
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "DEFAULT": (
        r"[\p{P}\$\+<=>\^~\|]+",
        r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
        r"\p{N}+",
        r"[0-9][0-9][0-9]",
    ),
}
# tokenizer.ggml.pre -> LLAMA_VOCAB_PRE_TYPE_*, from `llama_vocab::impl::load` (BPE vocabularies).
LLAMA_CPP_PRE_TYPES = {
    "default": "DEFAULT",
    "minicpm5": "MINICPM5",
    "llama3": "LLAMA3",
    "llama-v3": "LLAMA3",
    "llama-bpe": "LLAMA3",
    "falcon3": "LLAMA3",
    "falcon-h1": "LLAMA3",
    "pixtral": "LLAMA3",
    "midm-2.0": "LLAMA3",
    "lfm2": "LLAMA3",
    "jina-v5-nano": "LLAMA3",
    "deepseek-llm": "DEEPSEEK_LLM",
    "deepseek-coder": "DEEPSEEK_CODER",
    "deepseek-v3": "DEEPSEEK3_LLM",
    "spark2_5": "SPARK2_5",
    "youtu": "YOUTU",
    "falcon": "FALCON",
    "mpt": "MPT",
    "starcoder": "STARCODER",
    "gpt-2": "GPT2",
    "phi-2": "GPT2",
    "jina-es": "GPT2",
    "jina-de": "GPT2",
    "gigachat": "GPT2",
    "jina-v2-es": "GPT2",
    "jina-v2-de": "GPT2",
    "a.x-4.0": "GPT2",
    "mellum": "GPT2",
    "modern-bert": "GPT2",
    "jais-2": "JAIS2",
    "gemma4": "GEMMA4",
    "granite-embed-multi-311m": "GEMMA4",
    "sarvam-moe": "SARVAM_MOE",
    "jina-v1-en": "GPT2",
    "jina-v2-code": "GPT2",
    "roberta-bpe": "GPT2",
    "whitespace": "WHITESPACE",
    "refact": "REFACT",
    "command-r": "COMMAND_R",
    "qwen2": "QWEN2",
    "deepseek-r1-qwen": "QWEN2",
    "kormo": "QWEN2",
    "f2llmv2": "QWEN2",
    "qwen35": "QWEN35",
    "stablelm2": "STABLELM2",
    "olmo": "OLMO",
    "dbrx": "DBRX",
    "smaug-bpe": "SMAUG",
    "poro-chat": "PORO",
    "chatglm-bpe": "CHATGLM4",
    "glm4": "CHATGLM4",
    "glm5": "CHATGLM4",
    "viking": "VIKING",
    "jais": "JAIS",
    "tekken": "TEKKEN",
    "smollm": "SMOLLM",
    "codeshell": "CODESHELL",
    "bloom": "BLOOM",
    "gpt3-finnish": "GPT3_FINNISH",
    "exaone": "EXAONE",
    "exaone4": "GPT2",
    "exaone-moe": "EXAONE_MOE",
    "chameleon": "CHAMELEON",
    "minerva-7b": "MINERVA",
    "megrez": "QWEN2",
    "gpt-4o": "GPT4O",
    "llama4": "GPT4O",
    "kanana2": "GPT4O",
    "talkie": "GPT4O",
    "granite-embed-multi-97m": "GRANITE_EMB_MULTI",
    "tiny_aya": "TINY_AYA",
    "cohere2moe": "TINY_AYA",
    "superbpe": "SUPERBPE",
    "trillion": "TRILLION",
    "granite-docling": "GRANITE_DOCLING",
    "bailingmoe": "BAILINGMOE",
    "bailingmoe2": "BAILINGMOE",
    "llada-moe": "BAILINGMOE",
    "seed-coder": "SEED_CODER",
    "hunyuan": "HUNYUAN",
    "hunyuan-dense": "HUNYUAN_DENSE",
    "hy_v4": "HY_V4",
    "joyai-llm": "JOYAI_LLM",
    "kimi-k2": "KIMI_K2",
    "ufakzeka": "UFAKZEKA",
    "grok-2": "GROK_2",
    "afmoe": "AFMOE",
    "laguna": "LAGUNA",
    "minimax-m2": "MINIMAX_M2",
    "solar-open": "SOLAR_OPEN",
    "mellum2": "MELLUM2",
}

# Names whose split transformers' GGUF loader sets from tokenizer.ggml.pre (its
# GGUF_PRE_TOKENIZER_SPLITS), and the llama.cpp types that split like GPT-2, its fallback.
TRANSFORMERS_SPLIT_NAMES = (
    "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
    "jina-v5-nano", "dbrx", "smaug-bpe", "tekken", "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2",
    "megrez", "qwen35", "gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2",
)
# fmt: on
GPT2_TYPES = ("GPT2", "MPT", "OLMO", "JAIS", "TRILLION", "GRANITE_DOCLING")
TRANSFORMERS_NAMES = sorted(
    {*TRANSFORMERS_SPLIT_NAMES, *(n for n, t in LLAMA_CPP_PRE_TYPES.items() if t in GPT2_TYPES)}
)
RAW_UTF8_TYPES = ("GEMMA4", "SARVAM_MOE", "WHITESPACE")
BYTE_LEVEL_NAMES = sorted(n for n, t in LLAMA_CPP_PRE_TYPES.items() if t not in RAW_UTF8_TYPES)
RAW_UTF8_NAMES = sorted(n for n, t in LLAMA_CPP_PRE_TYPES.items() if t in RAW_UTF8_TYPES)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (openai/gpt-2, encoder.py)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    spelling = {b: chr(b) for b in printable}
    for b in range(256):
        if b not in spelling:
            spelling[b] = chr(256 + len(spelling) - len(printable))
    return spelling


BYTE_SPELLING = bytes_to_unicode()


def byte_level(text: str) -> str:
    return "".join(BYTE_SPELLING[b] for b in text.encode("utf-8"))


def reference_split(text: str, patterns: tuple[str, ...]) -> list[str]:
    """llama.cpp's `unicode_regex_split`: each pattern cuts every piece into its matches and the
    text between them; empty pieces are dropped."""
    pieces = [text]
    for pattern in patterns:
        # NOTE: the `regex` package reads class intersection (kimi-k2's "&&") only in V1 mode.
        compiled = regex.compile(pattern, regex.V1 if "&&" in pattern else 0)
        cut = []
        for piece in pieces:
            end = 0
            for match in compiled.finditer(piece):
                cut += [piece[end : match.start()], match.group()]
                end = match.end()
            cut.append(piece[end:])
        pieces = [piece for piece in cut if piece]
    return pieces


def reference_bpe(piece: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """GPT-2's BPE on one piece: merge the best-ranked adjacent pair until no pair has a rank."""
    parts = list(piece)
    while len(parts) > 1:
        rank, idx = min(
            (ranks.get(pair, len(ranks)), idx) for idx, pair in enumerate(zip(parts, parts[1:]))
        )
        if rank == len(ranks):
            break
        parts[idx : idx + 2] = [parts[idx] + parts[idx + 1]]
    return parts


@pytest.fixture(scope="module")
def vocab() -> dict[str, list]:
    """The 256 byte-alphabet tokens (in byte order), merges learned on SAMPLES with no pre-split
    (so merges span spaces, digits and punctuation alike), and one control token."""
    backend = BackendTokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=256 + 400, initial_alphabet=list(BYTE_SPELLING.values()), show_progress=False
    )
    backend.train_from_iterator(SAMPLES, trainer)
    model = json.loads(backend.to_str())["model"]
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in model["merges"]]
    alphabet = [BYTE_SPELLING[b] for b in range(256)]
    learned = [t for t in sorted(model["vocab"], key=model["vocab"].get) if t not in alphabet]
    tokens = [*alphabet, *learned, "<|endoftext|>"]
    return {"tokens": tokens, "merges": merges}


def write_gguf(path: Path, vocab: dict[str, list], pre: str | None) -> Path:
    """A GGUF with tiny llama hparams (transformers wants a config) and a byte-level tokenizer."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types([1] * (len(vocab["tokens"]) - 1) + [3])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(len(vocab["tokens"]) - 1)
    writer.add_eos_token_id(len(vocab["tokens"]) - 1)
    writer.add_add_bos_token(False)
    writer.add_tensor("token_embd.weight", np.zeros((len(vocab["tokens"]), 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_pieces_and_ids(text: str, llama_cpp_type: str, vocab: dict) -> tuple[list, list]:
    pieces = [byte_level(p) for p in reference_split(text, REFERENCE_SPLITS[llama_cpp_type])]
    ranks = {tuple(merge.split(" ", 1)): rank for rank, merge in enumerate(vocab["merges"])}
    token_ids = {token: idx for idx, token in enumerate(vocab["tokens"])}
    ids = [token_ids[t] for piece in pieces for t in reference_bpe(piece, ranks)]
    return pieces, ids


def pieces_of(backend: BackendTokenizer, text: str) -> list[str]:
    return [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(text)]


def test_every_llama_cpp_name_is_known() -> None:
    from tokenmill.tokenizer import gguf as tokenizer_gguf

    known = set(tokenizer_gguf._PRE_TOKENIZER_SPLITS) | set(tokenizer_gguf._RAW_UTF8_PRE_NAMES)
    assert set(LLAMA_CPP_PRE_TYPES) <= known
    assert set(tokenizer_gguf._RAW_UTF8_PRE_NAMES) == set(RAW_UTF8_NAMES)


@pytest.mark.parametrize("name", BYTE_LEVEL_NAMES)
def test_split_matches_llama_cpp_regexes(tmp_path: Path, vocab: dict, name: str) -> None:
    backend = load_gguf_tokenizer_spec(write_gguf(tmp_path / "t.gguf", vocab, name)).backend
    for text in SAMPLES:
        pieces, ids = expected_pieces_and_ids(text, LLAMA_CPP_PRE_TYPES[name], vocab)
        assert pieces_of(backend, text) == pieces, text
        assert backend.encode(text).ids == ids, text


@pytest.mark.parametrize("name", TRANSFORMERS_NAMES)
def test_split_matches_transformers(tmp_path: Path, vocab: dict, name: str) -> None:
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "t.gguf", vocab, name)
    backend = load_gguf_tokenizer_spec(path).backend
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SAMPLES:
        assert pieces_of(backend, text) == pieces_of(reference.backend_tokenizer, text), text
        assert backend.encode(text).ids == reference.encode(text, add_special_tokens=False), text


def test_samples_tell_the_types_apart() -> None:
    # Types with different regexes must split SAMPLES differently, or the tests above could not
    # catch a name mapped to the wrong type. Two pairs differ only in ways no text can show:
    # MINICPM5 cuts digits in threes before llama3's regex would; BAILINGMOE's "\s*[\r\n]" and
    # qwen2's "\s*[\r\n]+" match the same whitespace runs.
    first_type: dict[tuple[str, ...], str] = {}
    for llama_cpp_type, patterns in REFERENCE_SPLITS.items():
        first_type.setdefault(patterns, llama_cpp_type)
    by_split: dict[tuple, set[str]] = {}
    for patterns, llama_cpp_type in first_type.items():
        split = tuple(tuple(reference_split(text, patterns)) for text in SAMPLES)
        by_split.setdefault(split, set()).add(llama_cpp_type)
    alike = sorted(sorted(types) for types in by_split.values() if len(types) > 1)
    assert alike == [["BAILINGMOE", "STABLELM2"], ["LLAMA3", "MINICPM5"]]


@pytest.mark.parametrize(
    ("pre", "like"),
    [("my-llama-9", "llama-bpe"), ("qwen9", "qwen2"), ("deepseek-v9", "deepseek-v3"),
     ("brand-new", "gpt-2")],
)  # fmt: skip
def test_unknown_name_warns_and_falls_back(
    tmp_path: Path, vocab: dict, caplog: pytest.LogCaptureFixture, pre: str, like: str
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenmill.tokenizer.gguf"):
        backend = load_gguf_tokenizer_spec(write_gguf(tmp_path / "t.gguf", vocab, pre)).backend
    assert pre in caplog.text and repr(like) in caplog.text
    for text in SAMPLES:
        assert (
            pieces_of(backend, text)
            == expected_pieces_and_ids(text, LLAMA_CPP_PRE_TYPES[like], vocab)[0]
        )


def test_missing_name_splits_like_llama_cpp_default(
    tmp_path: Path, vocab: dict, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenmill.tokenizer.gguf"):
        backend = load_gguf_tokenizer_spec(write_gguf(tmp_path / "t.gguf", vocab, None)).backend
    assert "no tokenizer.ggml.pre" in caplog.text
    for text in SAMPLES:
        assert pieces_of(backend, text) == expected_pieces_and_ids(text, "DEFAULT", vocab)[0]


@pytest.mark.parametrize("name", RAW_UTF8_NAMES)
def test_raw_utf8_bpe_is_refused(tmp_path: Path, vocab: dict, name: str) -> None:
    with pytest.raises(ValueError, match="raw UTF-8"):
        load_gguf_tokenizer_spec(write_gguf(tmp_path / "t.gguf", vocab, name))
