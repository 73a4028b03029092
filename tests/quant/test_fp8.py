"""fp8 checkpoints (quant/fp8.py): e4m3 weights with per-tensor, per-row or per-block scales
kept a byte a weight; the reference matmul is exactly the checkpoint's values, and the
``torch._scaled_mm`` path (CUDA's; torch runs it on the CPU too) agrees with it to e4m3's
rounding of the activations. A tiny Llama written as an fp8 checkpoint (block-scaled, as
DeepSeek's and Qwen's; and per-row) matches transformers holding the same weights, kept as fp8
and dequantized (--quantization none)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import assert_all_blocks_free
from safetensors.torch import load_file, save_file

from tokenmill.engine import LLMEngine
from tokenmill.quant.fp8 import E4M3, fp8_matmul, pack_fp8
from tokenmill.sampling_params import SamplingParams


def _random_fp8(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.5).to(E4M3)


@pytest.mark.parametrize(
    ("scale", "block"),
    [(torch.tensor(0.03), None), (torch.rand(64) + 0.5, None), (torch.rand(2, 4) + 0.5, (32, 32))],
    ids=["per-tensor", "per-row", "per-block"],
)
def test_dequantize_is_code_times_scale(scale: torch.Tensor, block) -> None:
    codes = _random_fp8(64, 128, 0)
    w = pack_fp8(codes, scale, block)
    assert w.nbytes <= 64 * 128 * (1 + 4 / 32)  # a byte a weight, a float32 scale a group
    if block is None:
        expected = codes.float() * scale.reshape(-1, 1)
    else:
        expected = codes.float() * scale.repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(w.dequantize(), expected.expand(64, 128))


def test_scaled_mm_path_agrees_with_the_reference() -> None:
    w = pack_fp8(_random_fp8(96, 256, 1), torch.rand(96) * 0.1 + 0.01)
    x = torch.randn(5, 256)
    bias = torch.randn(96)
    exact = fp8_matmul(x, w, bias, scaled=False)
    assert torch.allclose(exact, x @ w.dequantize().T + bias, atol=1e-5)
    fast = fp8_matmul(x, w, bias, scaled=True)  # x rounded to e4m3 per row
    assert ((fast - exact).norm() / exact.norm()).item() < 0.05


def test_bad_scales_are_named() -> None:
    with pytest.raises(ValueError, match="scale of 2x4"):
        pack_fp8(_random_fp8(64, 128, 2), torch.rand(3, 3), (32, 32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        pack_fp8(torch.randn(4, 4), torch.tensor(1.0))


def _fp8_checkpoint(source, path, block: tuple[int, int] | None):
    """The tiny Llama's matrices as e4m3 with scales (the rest as they were), and transformers'
    model holding the values the checkpoint stands for."""
    from transformers import AutoModelForCausalLM

    shutil.copytree(source, path)
    state = load_file(str(path / "model.safetensors"))
    out = {}
    for name, t in state.items():
        if not (name.endswith("proj.weight") and t.dim() == 2):
            out[name] = t
            continue
        n, k = t.shape
        if block is None:  # a scale per row
            scale = t.abs().amax(1) / 448
            codes = (t / scale[:, None]).to(E4M3)
            out[name.removesuffix("weight") + "weight_scale"] = scale.reshape(n, 1)
        else:
            bn, bk = block
            blocks = t.reshape(n // bn, bn, k // bk, bk)
            scale = blocks.abs().amax((1, 3)) / 448
            codes = (blocks / scale[:, None, :, None]).reshape(n, k).to(E4M3)
            out[name.removesuffix("weight") + "weight_scale_inv"] = scale
        out[name] = codes
        state[name] = pack_fp8(codes, scale, block).dequantize()
    save_file(out, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        quant["weight_block_size"] = list(block)
    config["quantization_config"] = quant
    (path / "config.json").write_text(json.dumps(config))
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                     attn_implementation="eager")  # fmt: skip
    reference.load_state_dict(state)
    return reference.eval()


@pytest.mark.parametrize("block", [(32, 32), None], ids=["block-scaled", "per-row"])
@pytest.mark.parametrize("quantization", [None, "none"], ids=["kept-fp8", "dequantized"])
def test_an_fp8_checkpoint_matches_transformers(tiny_model_dir, tmp_path, block, quantization):
    hf = _fp8_checkpoint(tiny_model_dir("llama"), tmp_path / "fp8", block)
    engine = LLMEngine.from_args(model=str(tmp_path / "fp8"), max_model_len=128,
                                 kv_cache_memory="4MiB", quantization=quantization)  # fmt: skip
    prompt = [1] + list(range(40, 70))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    out = done[rid].outputs[0]
    ids = prompt + list(out.token_ids)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    for i, lp in enumerate(out.logprobs):
        pos = len(prompt) + i
        assert lp.sampled.logprob == pytest.approx(ref[pos - 1, ids[pos]].item(), abs=1e-4)
    assert engine.info.quantization == ("fp8" if quantization is None else None)
    assert_all_blocks_free(engine)
