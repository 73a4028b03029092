"""Benchmark prompts: random, shared-prefix, ShareGPT and JSONL datasets, each a list of
``SampleRequest`` (prompt, its length, the output length to ask for).

What a length means (``Dataset.length_unit``):
    "tokens"  with a tokenizer: a prompt's token count under it, without special tokens (the
              server may add a BOS, and a chat template adds its own tokens; its usage says)
    "words"   without one: random prompts are that many random English words, and ShareGPT
              lengths are whitespace-separated words (roughly 1.3 tokens each in most tokenizers)

random (vLLM's random dataset): each prompt's length is drawn uniformly from
``[floor(input_len * (1 - r)), ceil(input_len * (1 + r))]`` for range ratio r, its output
length likewise; with a tokenizer the prompt is random token ids from the middle of the
vocabulary (no special tokens there) decoded to text, re-encoded and cut to the drawn length
(the re-encoded count is the prompt length); as token ids directly for in-process runs.
shared-prefix: one common prefix of ``prefix_len`` then a distinct random suffix of
``input_len`` (with the range ratio): the prompt cache's workload.
sharegpt FILE: a JSON list of ``{"conversations": [{"from": "human"|"gpt", "value": ...}]}``;
the first human turn is the prompt, the gpt turn after it gives the output length unless
``output_len`` is set. As vLLM: conversations shuffled by the seed; without a fixed output
length, pairs with a prompt or reply under 4 or a prompt over 1024 or a total over 2048 are
skipped.
jsonl FILE: one ``{"prompt": "...", "output_len": N}`` a line (``output_len`` optional).
File datasets with fewer usable entries than ``num_prompts`` repeat them in order.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tokenmill.tokenizer import Tokenizer

DATASETS = ("random", "shared-prefix", "sharegpt", "jsonl")
FILE_DATASETS = ("sharegpt", "jsonl")
DEFAULT_OUTPUT_LEN = 128
# vLLM's ShareGPT filter (used when the output length comes from the reply).
MIN_SEQ_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048

_WORD_TEXT = (
    "the of and to in is was for that on as with by he at from his an were are which this be "
    "or has had not first one their its new after but who they have her she two been other when "
    "there all during into school time may years more most only over city some world would where "
    "later up such used many can state about national out known university united then made "
    "county american also film people part three team between since game music government "
    "season both well under year work include each number city river house water light north "
    "south small large place great long high early family group line village road system"
)
_WORDS = tuple(
    dict.fromkeys(_WORD_TEXT.split())
)  # common English words, for prompts without a tokenizer


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One benchmark request: a text prompt (or token ids, in process), its length in the
    dataset's unit, and the output tokens to ask for."""

    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass(frozen=True, slots=True)
class DatasetSpec:
    """What to sample. ``output_len`` None: the dataset's own (sharegpt's reply, a jsonl
    line's ``output_len``), else DEFAULT_OUTPUT_LEN."""

    name: str = "random"
    path: str | None = None
    num_prompts: int = 100
    input_len: int = 1024
    output_len: int | None = None
    range_ratio: float = 0.0
    prefix_len: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}; got {self.name!r}")
        if (self.name in FILE_DATASETS) != (self.path is not None):
            need = "needs a FILE" if self.name in FILE_DATASETS else "takes no FILE"
            raise ValueError(f"--dataset {self.name} {need}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"--range-ratio must be in [0, 1); got {self.range_ratio}")
        for flag, value in (("--num-prompts", self.num_prompts), ("--input-len", self.input_len)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1; got {value}")
        if self.output_len is not None and self.output_len < 1:
            raise ValueError(f"--output-len must be >= 1; got {self.output_len}")
        if self.prefix_len < 0:
            raise ValueError(f"--prefix-len must be >= 0; got {self.prefix_len}")


@dataclass(frozen=True, slots=True)
class Dataset:
    requests: list[SampleRequest]
    length_unit: str  # "tokens" | "words"


def dataset_spec_from(values: list[str] | None, **kwargs: Any) -> DatasetSpec:
    """``--dataset`` as parsed (``["random"]``, ``["sharegpt", "FILE"]``) and the length flags."""
    values = values or ["random"]
    if len(values) > 2:
        raise ValueError(f"--dataset takes a name and at most one FILE; got {' '.join(values)}")
    return DatasetSpec(name=values[0], path=values[1] if len(values) == 2 else None, **kwargs)


def sample_requests(
    spec: DatasetSpec, tokenizer: Tokenizer | None = None, token_ids: bool = False
) -> Dataset:
    """The spec's requests. ``token_ids``: random prompts as token ids (needs ``tokenizer``)."""
    rng = np.random.default_rng(spec.seed)
    unit = "tokens" if tokenizer is not None else "words"
    if spec.name == "sharegpt":
        return Dataset(_sharegpt(spec, tokenizer, rng), unit)
    if spec.name == "jsonl":
        return Dataset(_jsonl(spec, tokenizer), unit)
    gen = _RandomText(tokenizer, rng, token_ids)
    output_len = spec.output_len or DEFAULT_OUTPUT_LEN
    input_lens = _lengths(rng, spec.input_len, spec.range_ratio, spec.num_prompts)
    output_lens = _lengths(rng, output_len, spec.range_ratio, spec.num_prompts)
    prefix = gen.draw(spec.prefix_len) if spec.name == "shared-prefix" else gen.draw(0)
    requests = []
    for input_len, out_len in zip(input_lens, output_lens):
        prompt, prompt_len = gen.join(prefix, gen.draw(int(input_len)))
        requests.append(SampleRequest(prompt, prompt_len, int(out_len)))
    return Dataset(requests, unit)


def vocab_middle(vocab_size: int) -> tuple[int, int]:
    """The id range random prompts draw from: the middle of the vocabulary, where no
    tokenizer puts special or control tokens (they sit at either end)."""
    return min(1000, vocab_size // 4), max(vocab_size - 1000, vocab_size * 3 // 4)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    lo = max(1, math.floor(mean * (1 - ratio)))
    hi = max(lo, math.ceil(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n)


class _RandomText:
    """Random prompts of exact lengths: token ids (kept, or decoded to text) or words."""

    def __init__(self, tokenizer: Tokenizer | None, rng: np.random.Generator, ids: bool) -> None:
        if ids and tokenizer is None:
            raise ValueError("token-id prompts need a tokenizer")
        self.tokenizer, self.rng, self.ids = tokenizer, rng, ids
        if tokenizer is not None:
            self.lo, self.hi = vocab_middle(tokenizer.vocab_size)

    def draw(self, n: int) -> list[int] | str:
        if self.tokenizer is None:
            return " ".join(self.rng.choice(_WORDS, size=n).tolist())
        ids = self.rng.integers(self.lo, self.hi, size=n).tolist()
        if self.ids:
            return ids
        # Decoded ids re-encode to other ids (merges across boundaries, invalid UTF-8 as
        # U+FFFD): cut the re-encoded text back until it is at most n tokens again.
        tok = self.tokenizer
        encoded = tok.encode(tok.decode(ids), add_special_tokens=False)
        for keep in range(min(n, len(encoded)), 0, -1):
            text = tok.decode(encoded[:keep])
            if len(tok.encode(text, add_special_tokens=False)) <= n:
                return text
        return ""

    def join(self, prefix: list[int] | str, suffix: list[int] | str) -> tuple[str | list[int], int]:
        if isinstance(prefix, list) and isinstance(suffix, list):
            return prefix + suffix, len(prefix) + len(suffix)
        if self.tokenizer is None:
            text = f"{prefix} {suffix}" if prefix else suffix
            return text, len(text.split())
        # A space where neither side has one, so the prefix's last token stays whole.
        glue = "" if not prefix or prefix[-1:].isspace() or suffix[:1].isspace() else " "
        text = prefix + glue + suffix
        return text, len(self.tokenizer.encode(text, add_special_tokens=False))


def _length(text: str, tokenizer: Tokenizer | None) -> int:
    if tokenizer is None:
        return len(text.split())
    return len(tokenizer.encode(text, add_special_tokens=False))


def _read(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read dataset {path!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ValueError(f"dataset {path!r} is not UTF-8 text") from None


def _sharegpt(
    spec: DatasetSpec, tokenizer: Tokenizer | None, rng: np.random.Generator
) -> list[SampleRequest]:
    assert spec.path is not None
    try:
        data = json.loads(_read(spec.path))
    except json.JSONDecodeError as e:
        raise ValueError(f"sharegpt dataset {spec.path!r} is not JSON: {e}") from None
    if not isinstance(data, list):
        raise ValueError(f"sharegpt dataset {spec.path!r} is not a JSON list of conversations")
    pairs = [pair for entry in data if (pair := _first_exchange(entry)) is not None]
    if not pairs:
        raise ValueError(
            f"sharegpt dataset {spec.path!r} has no conversation with a human turn followed "
            'by a gpt turn ({"conversations": [{"from": "human", "value": ...}, ...]})'
        )
    order = rng.permutation(len(pairs))
    requests = []
    for idx in order:
        prompt, reply = pairs[idx]
        prompt_len = _length(prompt, tokenizer)
        output_len = spec.output_len or _length(reply, tokenizer)
        if spec.output_len is None and (
            prompt_len < MIN_SEQ_LEN
            or output_len < MIN_SEQ_LEN
            or prompt_len > MAX_PROMPT_LEN
            or prompt_len + output_len > MAX_TOTAL_LEN
        ):
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
        if len(requests) == spec.num_prompts:
            break
    if not requests:
        raise ValueError(f"sharegpt dataset {spec.path!r}: every conversation was filtered out")
    return _repeat(requests, spec.num_prompts)


def _first_exchange(entry: Any) -> tuple[str, str] | None:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list):
        return None
    for i, turn in enumerate(turns):
        if isinstance(turn, dict) and turn.get("from") == "human":
            reply = next(
                (t for t in turns[i + 1 :] if isinstance(t, dict) and t.get("from") == "gpt"),
                None,
            )
            prompt, answer = turn.get("value"), reply and reply.get("value")
            if isinstance(prompt, str) and prompt and isinstance(answer, str):
                return prompt, answer
            return None
    return None


def _jsonl(spec: DatasetSpec, tokenizer: Tokenizer | None) -> list[SampleRequest]:
    assert spec.path is not None
    requests = []
    for lineno, line in enumerate(_read(spec.path).splitlines(), 1):
        if not line.strip():
            continue
        where = f"jsonl dataset {spec.path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
            raise ValueError(f'{where}: want {{"prompt": "non-empty text", "output_len"?: N}}')
        output_len = spec.output_len or row.get("output_len", DEFAULT_OUTPUT_LEN)
        if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
            raise ValueError(f"{where}: output_len must be an integer >= 1")
        requests.append(SampleRequest(row["prompt"], _length(row["prompt"], tokenizer), output_len))
        if len(requests) == spec.num_prompts:
            break
    if not requests:
        raise ValueError(f"jsonl dataset {spec.path!r} has no prompts")
    return _repeat(requests, spec.num_prompts)


def _repeat(requests: list[SampleRequest], n: int) -> list[SampleRequest]:
    return [requests[i % len(requests)] for i in range(n)]
