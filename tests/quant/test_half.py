"""A bf16 / fp16 Hugging Face checkpoint on a CPU keeps its matrices as the file's halves
(quant/half.py) and runs on the packed kernel's half path: the same log-probs as the weights
widened to float32 (--quantization none), half the weight bytes, and decode-step graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tokenmill.engine import LLMEngine
from tokenmill.kernels import cpu_library
from tokenmill.quant.half import HalfQuantMethod
from tokenmill.sampling_params import SamplingParams


def _half_checkpoint(tiny_model_dir, tmp_path: Path, arch: str, dtype: torch.dtype) -> Path:
    """The tiny float32 checkpoint re-saved in ``dtype`` (with its tokenizer files)."""
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(arch)
    out = tmp_path / f"{arch}-{dtype}".replace("torch.", "")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _run(model: Path, **args: object) -> tuple[LLMEngine, list[list[float]]]:
    engine = LLMEngine.from_args(
        model=str(model), kv_cache_memory="8MiB", max_model_len=256, **args
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, ignore_eos=True)
    for i, prompt in enumerate(["hello world", "the quick brown fox jumps"]):
        engine.add_request(prompt, params, request_id=str(i))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0]
    rows = []
    for i in range(2):
        rows.append([lp.sampled.logprob for lp in finals[str(i)].logprobs])
        rows.append([float(t) for t in finals[str(i)].token_ids])
    return engine, rows


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("llama", torch.bfloat16), ("gemma3", torch.bfloat16), ("qwen3", torch.float16)],
)
def test_a_half_checkpoint_stays_halves_and_matches_float32(
    tiny_model_dir, tmp_path, arch: str, dtype: torch.dtype
) -> None:
    path = _half_checkpoint(tiny_model_dir, tmp_path, arch, dtype)
    halves, got = _run(path)
    floats, want = _run(path, quantization="none")
    assert halves.info.quantization == "half" and floats.info.quantization is None
    worker = halves.executor.worker
    kinds = {
        m.quant_state.weight.kind
        for m in worker.model.modules()
        if isinstance(getattr(m, "quant_method", None), HalfQuantMethod)
    }
    assert kinds == {"bf16" if dtype == torch.bfloat16 else "f16"}
    assert halves.info.weight_nbytes < 0.75 * floats.info.weight_nbytes
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-4)
    runner = worker.runner
    if cpu_library.available():  # every op of a decode step is a C kernel: it is recorded
        assert runner.decode_graphs is not None and runner.decode_graphs.captured_sizes()


def test_a_float32_checkpoint_stays_float_and_half_is_refused_for_gguf(tiny_model_dir) -> None:
    engine, _ = _run(tiny_model_dir("llama"))
    assert engine.info.quantization is None
    with pytest.raises(ValueError, match="quantization 'half'"):
        LLMEngine.from_args(model="gemma-3-270m", quantization="half", kv_cache_memory="8MiB")


def test_explicit_half_packs_a_float32_checkpoint_as_bf16(tiny_model_dir) -> None:
    engine, got = _run(tiny_model_dir("llama"), quantization="half")
    assert engine.info.quantization == "half"
    _, want = _run(tiny_model_dir("llama"))
    for g, w in zip(got[::2], want[::2], strict=True):  # bf16 rounding of float32 weights
        assert g == pytest.approx(w, abs=0.1)
