"""Quantized KV cache (kv_cache_dtype int8 / fp8): the helpers' error bounds, attention over the
dequantized cache for every key, outputs close to the float cache, more blocks for the same
budget, bad values refused, and no leaked blocks.

Measured on the tiny random models (8 prompts of 9..60 tokens, 16 greedy tokens, fp32 weights,
against kv_cache_dtype="auto"), max |logprob difference| over the top-5 while tokens agree, and
where the greedy tokens first differ (the float cache's logprob gap between the two picks):
    llama  int8: 0.0010; 1 of 8 prompts from token 9 (gap 0.0003)
    llama  fp8:  0.0068; 2 of 8 from tokens 9, 9 (gaps 0.0003, 0.0019)
    gemma3 int8: 0.036;  all 8 x 16 tokens agree
    gemma3 fp8:  0.17;   2 of 8 from tokens 7, 2 (gaps 0.083, 0.13)
Asserted (LOGPROB_TOL): llama 0.01 / 0.03, gemma3 0.08 / 0.3 (int8 / fp8), 0.002 / 0.01 for
float16; a flip only where
the gap is within 2x that; >= 75% of all greedy tokens agree.
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_all_blocks_free

from tokenmill import LLM
from tokenmill.attention import AttentionMetadata, PrefillSeq, dequantize_kv, quantize_kv
from tokenmill.attention.backends import TorchAttentionBackend
from tokenmill.attention.kv_cache import write_kv
from tokenmill.cli import build_parser, engine_args_from
from tokenmill.config import EngineArgs, ModelConfig
from tokenmill.engine import LLMEngine
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.model_runner import kv_bytes_per_block

QUANT = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
# Max |logprob difference| to the float cache allowed (see the measurements above).
LOGPROB_TOL = {("llama", "int8"): 0.01, ("llama", "fp8"): 0.03}
LOGPROB_TOL |= {("gemma3", "int8"): 0.08, ("gemma3", "fp8"): 0.3}
LOGPROB_TOL |= {("llama", "float16"): 0.002, ("gemma3", "float16"): 0.01}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, logprobs=5, ignore_eos=True)


def rows_of_mixed_scale(n: int, seed: int) -> torch.Tensor:
    """[n, 2, 32]: rows whose magnitudes span four decades, one all-zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, 32, generator=g) * torch.logspace(-3, 1, n)[:, None, None]
    x[n // 2, 1] = 0.0
    return x


# ---- helpers -----------------------------------------------------------------------------------


def test_int8_error_is_at_most_half_a_step() -> None:
    x = rows_of_mixed_scale(64, seed=0)
    q, scale = quantize_kv(x, torch.int8)
    assert q.dtype == torch.int8 and q.shape == x.shape and q.abs().max() <= 127
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:2]
    torch.testing.assert_close(scale, x.abs().amax(-1) / 127)
    err = (dequantize_kv(q, scale, torch.float32) - x).abs()
    assert torch.all(err <= scale[..., None] / 2 * (1 + 1e-5))
    assert torch.all(dequantize_kv(q, scale, torch.float32)[32, 1] == 0)  # the zero row


def test_fp8_relative_error() -> None:
    x = rows_of_mixed_scale(64, seed=1)
    q, scale = quantize_kv(x, torch.float8_e4m3fn)
    assert q.dtype == torch.float8_e4m3fn and q.float().abs().max() <= 448
    torch.testing.assert_close(scale, x.abs().amax(-1) / 448)
    err = (dequantize_kv(q, scale, torch.float32) - x).abs()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values (|x| / scale >=
    # 2^-6); below that, subnormals have a fixed step of 2^-9, so at most half of it.
    normal = x.abs() >= scale[..., None] * 2**-6
    assert normal.float().mean() > 0.9
    assert torch.all(err[normal] <= x.abs()[normal] * 2**-4 * (1 + 1e-5))
    assert torch.all(err[~normal] <= (scale[..., None] * 2**-10 * (1 + 1e-5)).expand_as(x)[~normal])
    assert torch.all(err <= x.abs().amax(-1, keepdim=True) * 2**-3)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_write_kv_stores_payload_and_scales_at_the_slots(kv_dtype) -> None:
    x = rows_of_mixed_scale(12, seed=2).to(torch.bfloat16)  # the model dtype may be bf16
    cache = torch.zeros(4, 8, 2, 32, dtype=QUANT[kv_dtype])
    scales = torch.zeros(4, 8, 2)
    slots = torch.tensor(random.Random(0).sample(range(32), 12))
    write_kv(cache, scales, slots, x)
    rows = dequantize_kv(cache.view(-1, 2, 32), scales.view(-1, 2), torch.float32)
    expected = dequantize_kv(*quantize_kv(x, QUANT[kv_dtype]), torch.float32)
    assert torch.equal(rows[slots], expected)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(rows[untouched] == 0)


# ---- attention ---------------------------------------------------------------------------------

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BS = 4, 2, 16, 8


def _two_steps(kv_dtype: str | None, window: int | None, fake_quant: str | None = None):
    """Step 1: prefills A (10 tokens, blocks 1-2) and B (5, block 3) from scratch. Step 2: A
    decodes one token, B prefills 4 more on top of its 5 (blocks 3-4). Returns both outputs.

    kv_dtype None: a float cache; fake_quant then rounds K/V through that format beforehand.
    """
    g = torch.Generator().manual_seed(3)

    def qkv(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(n, NUM_HEADS, HEAD_DIM, generator=g)
        k, v = (torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g) * 2 for _ in range(2))
        if fake_quant is not None:
            k, v = (
                dequantize_kv(*quantize_kv(t, QUANT[fake_quant]), torch.float32) for t in (k, v)
            )
        return q, k, v

    shape = (6, BS, NUM_KV_HEADS, HEAD_DIM)
    dtype = QUANT[kv_dtype] if kv_dtype else torch.float32
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    kv_scales = (torch.zeros(shape[:-1]), torch.zeros(shape[:-1])) if kv_dtype else None
    backend = TorchAttentionBackend()
    scale = HEAD_DIM**-0.5

    def meta(slots, num_decodes, table, seq_lens, prefills) -> AttentionMetadata:
        return AttentionMetadata(
            block_size=BS,
            slot_mapping=torch.tensor(slots),
            num_decodes=num_decodes,
            decode_block_table=table,
            decode_seq_lens=torch.tensor(seq_lens, dtype=torch.long),
            prefills=prefills,
        )

    step1 = meta(
        list(range(8, 18)) + list(range(24, 29)),
        0,
        torch.zeros((0, 1), dtype=torch.long),
        [],
        [
            PrefillSeq(0, 10, 0, torch.tensor([1, 2])),
            PrefillSeq(10, 5, 0, torch.tensor([3])),
        ],
    )
    out1 = backend.forward(*qkv(15), k_cache, v_cache, step1, scale, window, kv_scales)
    step2 = meta(
        [18, 29, 30, 31, 32],
        1,
        torch.tensor([[1, 2]]),
        [11],
        [PrefillSeq(1, 4, 5, torch.tensor([3, 4]))],
    )
    out2 = backend.forward(*qkv(5), k_cache, v_cache, step2, scale, window, kv_scales)
    return out1, out2


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("window", [None, 4])
def test_attention_uses_the_dequantized_cache_for_every_key(kv_dtype, window) -> None:
    quantized = _two_steps(kv_dtype, window)
    # The same K/V rounded through the format beforehand, attended from a float cache.
    reference = _two_steps(None, window, fake_quant=kv_dtype)
    plain = _two_steps(None, window)
    for got, ref, raw in zip(quantized, reference, plain):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        # And the rounding is visible: a fresh prefill chunk did not attend to its raw K/V.
        assert (got - raw).abs().max() > 1e-3


# ---- through the engine ------------------------------------------------------------------------

_RUNS: dict[tuple[str, str], list] = {}


def prompts_for(n: int, seed: int, lo: int = 8, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 259) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def run(engine: LLMEngine, prompts, params=GREEDY) -> list:
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert_all_blocks_free(engine)
    return [done[i] for i in ids]


def greedy_runs(path, arch: str, kv_dtype: str) -> list:
    if (arch, kv_dtype) not in _RUNS:
        engine = LLMEngine.from_args(
            model=str(path),
            max_model_len=256,
            kv_cache_memory="8MiB",
            kv_cache_dtype=kv_dtype,
            max_num_batched_tokens=64,  # some prompts are chunked
            num_threads=1,
        )
        _RUNS[arch, kv_dtype] = [o.outputs[0] for o in run(engine, prompts_for(8, seed=0))]
    return _RUNS[arch, kv_dtype]


@pytest.mark.parametrize("kv_dtype", ["float16", "int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_outputs_track_the_float_cache(tiny_model_dir, arch, kv_dtype) -> None:
    path = tiny_model_dir(arch)
    tol = LOGPROB_TOL[arch, kv_dtype]
    num_agreeing = 0
    for ref, got in zip(greedy_runs(path, arch, "auto"), greedy_runs(path, arch, kv_dtype)):
        n = 0
        while n < len(ref.token_ids) and ref.token_ids[n] == got.token_ids[n]:
            n += 1
        num_agreeing += n
        for pos in range(min(n + 1, len(ref.token_ids))):
            ref_top = {t.token_id: t.logprob for t in ref.logprobs[pos].top}
            got_top = {t.token_id: t.logprob for t in got.logprobs[pos].top}
            shared = ref_top.keys() & got_top.keys()
            assert len(shared) >= 4
            for tok in shared:
                assert got_top[tok] == pytest.approx(ref_top[tok], abs=tol)
        if n < len(ref.token_ids):
            # A flip only at a near-tie of the float cache's own top two.
            ref_top = {t.token_id: t.logprob for t in ref.logprobs[n].top}
            assert ref_top[ref.token_ids[n]] - ref_top[got.token_ids[n]] <= 2 * tol
    assert num_agreeing >= 0.75 * 8 * 16


def _config(num_layers: int, num_kv_heads: int, head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="gemma3",
        vocab_size=1,
        hidden_size=1,
        intermediate_size=1,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=1,
    )


def test_quantized_cache_holds_more_blocks_for_the_same_budget(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    budget = 4 * 2**20
    engines = {
        kv_dtype: LLMEngine.from_args(
            model=path, max_model_len=128, kv_cache_memory=budget, kv_cache_dtype=kv_dtype
        )
        for kv_dtype in ("auto", "float16", "int8", "fp8")
    }
    config = engines["auto"].config.model_config
    for kv_dtype, engine in engines.items():
        caches = engine.executor.worker.runner.kv_caches
        expected = {"auto": torch.float32, "float16": torch.float16}
        assert caches[0][0].dtype == QUANT.get(kv_dtype, expected.get(kv_dtype))
        assert len(caches[0]) == (2 if kv_dtype in expected else 4)  # K, V (+ their scales)
        # The sizing counts the real bytes, scales included, and stays within the budget.
        allocated = sum(t.numel() * t.element_size() for layer in caches for t in layer)
        per_block = kv_bytes_per_block(config, 16, torch.float32, kv_dtype)
        assert allocated == caches[0][0].shape[0] * per_block <= budget
    # head_dim 16 in fp32: 64 bytes per head and token vs 16 + a 4-byte scale, 3.2x (and
    # >= 1.9x, the least a quantized cache must give).
    auto_blocks = engines["auto"].num_total_blocks
    assert engines["float16"].num_total_blocks >= 1.95 * auto_blocks
    for kv_dtype in ("int8", "fp8"):
        assert engines[kv_dtype].num_total_blocks >= 3.1 * auto_blocks
    # gemma-3-270m's shape (18 layers, 1 KV head, head_dim 256): ~2x bf16, ~3.9x fp32.
    big = _config(18, 1, 256)
    int8_block = kv_bytes_per_block(big, 16, torch.bfloat16, "int8")
    assert kv_bytes_per_block(big, 16, torch.bfloat16) / int8_block >= 1.9
    assert kv_bytes_per_block(big, 16, torch.float32) / int8_block >= 3.9
    assert kv_bytes_per_block(big, 16, torch.float32, "fp8") == int8_block


def test_bfloat16_model_with_an_int8_cache(tiny_model_dir) -> None:
    kwargs = dict(model=str(tiny_model_dir("llama")), max_model_len=128, dtype="bfloat16")
    kwargs |= dict(kv_cache_memory="2MiB", num_threads=1)
    ref = run(LLMEngine.from_args(**kwargs), prompts_for(2, seed=4))
    got = run(LLMEngine.from_args(**kwargs, kv_cache_dtype="int8"), prompts_for(2, seed=4))
    for r, o in zip(ref, got):
        assert o.outputs[0].token_ids[:4] == r.outputs[0].token_ids[:4]


# ---- arguments ---------------------------------------------------------------------------------


def test_bad_kv_cache_dtype_is_a_value_error_naming_the_field(tiny_model_dir) -> None:
    for bad in ("fp16", "float8", "", "INT8"):
        with pytest.raises(
            ValueError, match="kv_cache_dtype must be one of auto, float16, int8, fp8"
        ):
            EngineArgs(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(tiny_model_dir("llama")), kv_cache_dtype="int4")


def test_llm_and_cli_take_kv_cache_dtype(tiny_model_dir) -> None:
    path = str(tiny_model_dir("llama"))
    llm = LLM(path, kv_cache_dtype="fp8", max_model_len=64, kv_cache_memory="1MiB")
    assert llm.engine.executor.worker.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    (out,) = llm.generate([[1, 40, 41, 42]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3
    assert_all_blocks_free(llm.engine)
    parser = build_parser()
    for command in (["serve"], ["generate", "--prompt", "hi"], ["bench", "latency"]):
        ns = parser.parse_args([*command, path, "--kv-cache-dtype", "int8"])
        assert engine_args_from(ns).kv_cache_dtype == "int8"
        assert engine_args_from(parser.parse_args([*command, path])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["serve", path, "--kv-cache-dtype", "int4"])
    assert exc.value.code == 2


# ---- blocks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["float16", "int8", "fp8"])
def test_preemption_and_prefix_caching_return_every_block(tiny_model_dir, kv_dtype) -> None:
    path = str(tiny_model_dir("llama"))
    common = dict(model=path, max_model_len=96, block_size=8, kv_cache_dtype=kv_dtype)
    common |= dict(max_num_batched_tokens=20, num_threads=1)
    roomy = LLMEngine.from_args(**common, kv_cache_memory="4MiB")
    config = roomy.config.model_config
    # 16 usable blocks = 128 tokens for 6 requests of up to ~75 tokens each: forces preemption.
    tight = LLMEngine.from_args(
        **common,
        kv_cache_memory=kv_bytes_per_block(config, 8, torch.float32, kv_dtype) * 17,
        enable_prefix_caching=False,
    )
    assert tight.num_total_blocks == 16
    prompts = prompts_for(6, seed=2, lo=20, hi=58)
    refs = run(roomy, prompts)  # (run checks that all blocks are free after each batch)
    outs = run(tight, prompts)
    assert tight.scheduler.num_preemptions > 0
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # Prefix hits read quantized blocks (payload and scales) that an earlier request wrote,
    # and continue as a cold prefill of the whole prompt does.
    shared = prompts_for(1, seed=9, lo=40, hi=41)[0]  # 41 tokens: 5 full blocks
    followers = [shared + p[:5] for p in prompts[:3]]
    run(roomy, [shared])
    hits = run(roomy, followers)
    assert [h.metrics.num_cached_tokens for h in hits] == [40, 40, 40]
    for hit, cold in zip(hits, run(tight, followers)):
        assert cold.metrics.num_cached_tokens == 0
        assert hit.outputs[0].token_ids == cold.outputs[0].token_ids
