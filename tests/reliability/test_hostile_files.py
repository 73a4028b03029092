"""Hostile model files: a GGUF damaged or crafted byte by byte, and chat templates that try to
reach Python's internals. Each is a clear ValueError (the CLI: one line on stderr, exit 2),
never a traceback, a hang, a huge allocation or code run.

The files start as one valid tiny Llama GGUF written with gguf.GGUFWriter (it loads and
generates: the control case), then one field is changed at its byte position.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.cli import main
from tokenmill.modelfile import read_gguf
from tokenmill.tokenizer.chat import ChatTemplate

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 128
TOKENS = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁hi", "▁there"]
FIRST_KEY_POS = 24  # magic, version, tensor count, key count: then the first key's length
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def write_gguf(
    path: Path, block_count: int | None = 1, template: str = TEMPLATE, **meta: Any
) -> Path:
    """A 1-layer Llama of float32 random weights with a SentencePiece vocabulary; ``meta``
    replaces what one GGUFWriter.add_<name> call writes (``head_count=10**6``)."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), "llama")

    def add(name: str, value: Any) -> None:
        getattr(writer, f"add_{name}")(meta.get(name, value))

    if block_count is not None:
        writer.add_block_count(block_count)
    add("context_length", 128)
    add("embedding_length", HIDDEN)
    add("feed_forward_length", FFN)
    add("head_count", HEADS)
    add("head_count_kv", KV_HEADS)
    add("key_length", HEAD_DIM)
    add("value_length", HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    add("tokenizer_model", "llama")
    add("token_list", TOKENS)
    writer.add_token_types([2, 3, 3, *[6] * 256, 1, 1])
    writer.add_token_scores([0.0] * len(TOKENS))
    add("bos_token_id", 1)
    add("eos_token_id", 2)
    writer.add_chat_template(template)
    shapes = {"token_embd.weight": (len(TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,)}
    kv = KV_HEADS * HEAD_DIM
    for name, shape in {
        "attn_norm": (HIDDEN,),
        "attn_q": (HEADS * HEAD_DIM, HIDDEN),
        "attn_k": (kv, HIDDEN),
        "attn_v": (kv, HIDDEN),
        "attn_output": (HIDDEN, HEADS * HEAD_DIM),
        "ffn_norm": (HIDDEN,),
        "ffn_gate": (FFN, HIDDEN),
        "ffn_up": (FFN, HIDDEN),
        "ffn_down": (HIDDEN, FFN),
    }.items():
        shapes[f"blk.0.{name}.weight"] = shape
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.normal(0, 0.2, size=shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf").read_bytes()


def _tensor_info_at(data: bytes, name: str) -> int:
    """Byte position of tensor ``name``'s info (its name's length field)."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded)


def _info_fields(data: bytes, name: str) -> dict[str, int]:
    """Positions of a tensor info's fields: n_dims, dims[0], type, offset."""
    pos = _tensor_info_at(data, name) + 8 + len(name.encode())
    (num_dims,) = struct.unpack_from("<I", data, pos)
    dims = pos + 4
    type_pos = dims + 8 * num_dims
    return {"n_dims": pos, "dims": dims, "type": type_pos, "offset": type_pos + 4}


def _patch(data: bytes, pos: int, fmt: str, value: int) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, pos, value)
    return bytes(out)


def _value_type_pos(data: bytes, key: str) -> int:
    encoded = key.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def _corruptions(good: bytes) -> dict[str, tuple[bytes, str]]:
    """name -> (file bytes, a phrase the error must contain)."""
    q = _info_fields(good, "blk.0.attn_q.weight")
    last = _info_fields(good, "blk.0.ffn_down.weight")
    return {
        "truncated tensor data": (good[: len(good) - 1000], "past the end of the file"),
        "truncated header": (good[:200], "damaged GGUF"),
        "offset past the end": (_patch(good, q["offset"], "<Q", 2**40), "past the end of the file"),
        "misaligned offset": (_patch(good, q["offset"], "<Q", 3), "not aligned"),
        "absurd dimension": (_patch(good, q["dims"], "<Q", 2**40), "past the end of the file"),
        "dimension overflowing 64 bits": (
            _patch(_patch(good, last["dims"], "<Q", 2**63), last["dims"] + 8, "<Q", 2**63),
            "past the end of the file",
        ),
        "too many dimensions": (_patch(good, q["n_dims"], "<I", 2**31), "dimensions"),
        "string past the end": (_patch(good, FIRST_KEY_POS, "<Q", 2**40), "past the end"),
        "unknown tensor type": (_patch(good, q["type"], "<I", 0xFFFF), "unknown tensor type"),
        "unknown value type": (
            _patch(good, _value_type_pos(good, "llama.block_count"), "<I", 99),
            "unknown metadata value type",
        ),
        "huge array count": (
            _patch(good, _value_type_pos(good, "tokenizer.ggml.scores") + 8, "<Q", 2**62),
            "past the end",
        ),
        "tensor count past the header": (_patch(good, 8, "<Q", 2**60), "damaged GGUF"),
        "not gguf": (b"GGML" + good[4:], "not a GGUF file"),
        "empty file": (b"", "not a GGUF file"),
    }


CASES = [
    "truncated tensor data",
    "truncated header",
    "offset past the end",
    "misaligned offset",
    "absurd dimension",
    "dimension overflowing 64 bits",
    "too many dimensions",
    "string past the end",
    "unknown tensor type",
    "unknown value type",
    "huge array count",
    "tensor count past the header",
    "not gguf",
    "empty file",
]


def test_the_control_file_loads_and_generates(good: bytes, tmp_path: Path, capsys) -> None:
    path = tmp_path / "good.gguf"
    path.write_bytes(good)
    assert len(read_gguf(path).tensors) == 11
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 0


@pytest.mark.parametrize("case", CASES)
def test_damaged_gguf_is_a_clear_value_error(good: bytes, tmp_path: Path, case: str) -> None:
    data, phrase = _corruptions(good)[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=phrase) as info:
        read_gguf(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("case", CASES)
def test_damaged_gguf_cli_one_line_exit_2(good: bytes, tmp_path: Path, case: str, capsys) -> None:
    data, phrase = _corruptions(good)[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tokenmill: error:") and phrase in err[0], err


@pytest.mark.parametrize(
    ("block_count", "phrase"),
    [(None, "llama.block_count"), (10**9, "block_count"), (2, "block_count")],
)
def test_metadata_that_disagrees_with_the_tensors(
    tmp_path: Path, capsys, block_count: int | None, phrase: str
) -> None:
    """A missing key, or a layer count the tensors do not have (a billion layers would be
    built before the first weight is read)."""
    path = write_gguf(tmp_path / "meta.gguf", block_count=block_count)
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err


@pytest.mark.parametrize(
    ("meta", "phrase"),
    [
        ({"bos_token_id": 10**6}, "bos_token_id is 1000000, outside the vocabulary"),
        ({"eos_token_id": 10**6}, "eos_token_id is 1000000, outside the vocabulary"),
        ({"token_list": []}, "no tokenizer.ggml.tokens nor vocab_size"),
        ({"head_count": 10**6}, "but the metadata describes (16000000, 64)"),
        ({"head_count_kv": 0}, "head_count_kv must be a positive integer"),
        ({"head_count_kv": 3}, "not a multiple of attention.head_count_kv"),
        ({"key_length": 10**9}, "tensor 'blk.0.attn_q.weight' has shape (64, 64)"),
        ({"embedding_length": 2**31}, "tensor 'token_embd.weight' has shape"),
        ({"tokenizer_model": "weird"}, "Unsupported GGUF tokenizer model"),
    ],
)
def test_metadata_dimensions_are_checked_before_building(
    tmp_path: Path, capsys, meta: dict[str, Any], phrase: str
) -> None:
    """Metadata the tensors do not back: a BOS id past the vocabulary segfaulted in the
    embedding kernel; a zero KV head count divided by zero; a million heads or a 10**9 key
    length were allocated for (RuntimeError) before any weight was read."""
    path = write_gguf(tmp_path / "meta.gguf", **meta)
    assert main(["generate", str(path), "--prompt", "hi there", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and phrase in err[0], err


def test_tokenizer_ids_past_the_model_vocabulary_are_refused(tiny_model_dir, tmp_path) -> None:
    """A Hugging Face directory whose tokenizer has more tokens than the model's embedding:
    a prompt that encodes to such an id is a ValueError, not an unchecked row index."""
    import shutil

    from tokenizers import Tokenizer as BackendTokenizer

    from tokenmill.engine import LLMEngine

    model_dir = tmp_path / "mismatch"
    shutil.copytree(tiny_model_dir("llama"), model_dir)
    backend = BackendTokenizer.from_file(str(model_dir / "tokenizer.json"))
    backend.add_special_tokens([f"<extra{i}>" for i in range(130)])  # ids 259..388 >= 384
    backend.save(str(model_dir / "tokenizer.json"))
    engine = LLMEngine.from_args(model=str(model_dir), max_model_len=64, kv_cache_memory="1MiB")
    with pytest.raises(ValueError, match="token id 388, outside the model's vocabulary of 384"):
        engine.add_request("hi <extra129>")
    engine.add_request("hi <extra0>")  # id 259 is inside the embedding: served
    while engine.has_unfinished_requests():
        engine.step()


# ---- chat templates --------------------------------------------------------------------------

ESCAPES = [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.system('touch {marker}') }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].system('touch {marker}') }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['datetime'] }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ self.__init__.__globals__ }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ ('{0.__globals__}' | format(cycler.__init__)) }}",
    "{% set x = messages.append(1) %}{{ x }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ (messages | attr('__class__')).__base__ }}",
]


@pytest.mark.parametrize("source", ESCAPES)
def test_template_cannot_reach_python_internals(source: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    template = ChatTemplate(source.replace("{marker}", str(marker)))
    messages = [{"role": "user", "content": "hi"}]
    try:
        text = template.render(messages)
    except ValueError as e:
        assert "chat template" in str(e)
    else:  # the sandbox renders an unsafe attribute as undefined: nothing leaks
        assert text == "", text
    assert not marker.exists()
    assert messages == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "source",
    [
        "{{ 1 / 0 }}",
        "{{ range(10**12) | list }}",
        "{{ 'x' * 10**12 }}",
        "{{ [1] * 10**12 }}",
        "{{ 2 ** 100000000 }}",
        "{% set n = 10 ** 9 %}{{ 7 ** n }}",
        "{% set s = 'ab' %}{% set n = 10 ** 7 %}{{ s * n }}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "{{ none.x.y }}",
    ],
)
def test_template_runtime_faults_are_value_errors(source: str) -> None:
    """Anything a template can do at run time is the template's error: a ValueError (a 400 in
    the server), not a TypeError, OverflowError or RecursionError escaping as a 500, and no
    terabyte string built."""
    template = ChatTemplate(source)
    with pytest.raises(ValueError, match="chat template"):
        template.render([{"role": "user", "content": "hi"}])


def test_hostile_template_in_a_gguf_file(tmp_path: Path, capsys) -> None:
    """Through the whole path: the CLI chats with a file whose template tries an escape."""
    marker = tmp_path / "pwned"
    source = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    path = write_gguf(tmp_path / "evil.gguf", template=source)
    code = main(["generate", str(path), "--prompt", "hi", "--max-tokens", "1", "--chat"])
    err = capsys.readouterr().err.strip().splitlines()
    assert not marker.exists()
    assert code == 2 and len(err) == 1 and "chat template" in err[0], err


@pytest.mark.parametrize(
    "name", ["token_embd.weight", "blk.0.attn_q.weight", "blk.0.ffn_norm.weight"]
)
def test_tensor_shape_disagreeing_with_the_metadata(
    good: bytes, tmp_path: Path, capsys, name: str
) -> None:
    """A tensor that fits in the file but not the model the metadata describes (its first
    dimension halved): the load names it and both shapes (the norm, in the loader's own
    check; the others before the model is built)."""
    pos = _info_fields(good, name)["dims"]
    (cols,) = struct.unpack_from("<Q", good, pos)
    path = tmp_path / "shape.gguf"
    path.write_bytes(_patch(good, pos, "<Q", cols // 2))
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has shape" in err[0], err
    assert ("the model expects" if "norm" in name else f"tensor {name!r}") in err[0], err


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_random_header_damage_is_a_value_error_or_reads(good: bytes, tmp_path: Path, data) -> None:
    """Random bytes overwritten in the header, or the file cut anywhere: read_gguf returns a
    header whose tensors all lie inside the file, or raises ValueError; nothing else."""
    header_len = read_gguf_header_len(good)
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, header_len - 1))
        width = data.draw(st.sampled_from([1, 4, 8]))
        raw[pos : pos + width] = data.draw(st.binary(min_size=width, max_size=width))
    if data.draw(st.booleans()):
        del raw[data.draw(st.integers(0, len(raw))) :]
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(raw))
    try:
        header = read_gguf(path)
    except ValueError:
        return
    for tensor in header.tensors:
        assert tensor.offset >= 0 and tensor.offset + tensor.num_bytes <= len(raw)


def read_gguf_header_len(data: bytes) -> int:
    """Where the tensor data starts in the control file (the header is everything before)."""
    return _info_fields(data, "blk.0.ffn_down.weight")["offset"] + 8
