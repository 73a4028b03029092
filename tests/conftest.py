"""Shared factories: tiny random-weight models per architecture, engines, and a block-leak check."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tokenmill.tokenizer.byte_level import write_byte_tokenizer

# Without a GPU, Triton kernels run in Triton's interpreter (numpy, on CPU tensors): set before
# any test imports triton, which reads it when a kernel is first launched.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def triton_device() -> torch.device:
    """Where the Triton tests run their kernels: CUDA where a GPU is present, so the compiled
    kernels are what is tested; else the CPU, in Triton's interpreter (TRITON_INTERPRET above).
    Tests build their inputs on the CPU (a CPU torch.Generator, the same numbers on every
    machine) and move them here."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_configure(config: pytest.Config) -> None:
    """Where the C kernels are required (CI: TOKENMILL_REQUIRE_EXTENSION=1), a missing or
    unloadable extension fails the run: its tests would otherwise skip and pass silently."""
    if os.environ.get("TOKENMILL_REQUIRE_EXTENSION") != "1":
        return
    from tokenmill.kernels import cpu_library

    if not cpu_library.available():
        raise pytest.UsageError(
            "TOKENMILL_REQUIRE_EXTENSION=1 but the C kernels (tokenmill._qgemm) did not load: "
            "reinstall with a C compiler (pip install -e .) and see the build log"
        )


# Run only when ``-m`` names them: soak tests take minutes each; timing tests compare
# timings, which on a shared VM its neighbours' minute-to-minute load decides.
OPT_IN_MARKERS = ("soak", "timing")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the OPT_IN_MARKERS' tests unless ``-m`` names their marker."""
    named = config.option.markexpr or ""
    for marker in OPT_IN_MARKERS:
        if marker in named:
            continue
        left_out = [item for item in items if item.get_closest_marker(marker) is not None]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item.get_closest_marker(marker) is None]


TINY_COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


PHI3_LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
    "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.2, 2.5, 4.0, 7.5],
}  # fmt: skip


def _tiny_hf_config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(
            **TINY_COMMON,
            num_hidden_layers=2,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "mistral":
        return tf.MistralConfig(**TINY_COMMON, num_hidden_layers=2, sliding_window=24)
    if arch == "qwen2":
        return tf.Qwen2Config(**TINY_COMMON, num_hidden_layers=2, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**TINY_COMMON, num_hidden_layers=2)
    if arch == "smollm3":  # NoPE every second layer (the released models: every fourth)
        return tf.SmolLM3Config(**TINY_COMMON, num_hidden_layers=4, no_rope_layer_interval=2)
    if arch == "olmo2":
        return tf.Olmo2Config(**TINY_COMMON, num_hidden_layers=2)
    if arch == "phi3":  # LongRoPE on half of each head (Phi-4-mini: 3/4), a 256-token original
        return tf.Phi3Config(**TINY_COMMON, num_hidden_layers=2, original_max_position_embeddings=256,
                             rope_parameters=PHI3_LONGROPE)  # fmt: skip
    if arch == "gemma2":  # caps low enough to bend these random models' scores and logits
        return tf.Gemma2Config(**TINY_COMMON, num_hidden_layers=4, sliding_window=24,
                               query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                               final_logit_softcapping=5.0)  # fmt: skip
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            **TINY_COMMON, num_hidden_layers=6, sliding_window=24, query_pre_attn_scalar=16
        )
    # Gemma 4: global layers with heads twice as wide, proportional RoPE over a quarter of them
    # and a final soft-cap. "gemma4" (31B's shape): one KV head there, k = v. "gemma4_ple"
    # (E2B's): per-layer embeddings, the last two layers sharing layers 2's and 3's K/V with
    # double-wide MLPs. "gemma4_moe" (26B-A4B's): top-2 of 8 experts beside every MLP.
    gemma4 = dict(sliding_window=24, global_head_dim=32, final_logit_softcapping=10.0,
                  layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2)  # fmt: skip
    if arch == "gemma4":
        return tf.Gemma4TextConfig(**TINY_COMMON, **gemma4, num_hidden_layers=6,
                                   attention_k_eq_v=True, num_global_key_value_heads=1,
                                   hidden_size_per_layer_input=0)  # fmt: skip
    if arch == "gemma4_ple":
        return tf.Gemma4TextConfig(**TINY_COMMON, **gemma4, num_hidden_layers=6,
                                   hidden_size_per_layer_input=8, vocab_size_per_layer_input=384,
                                   num_kv_shared_layers=2, use_double_wide_mlp=True)  # fmt: skip
    if arch == "gemma4_moe":
        return tf.Gemma4TextConfig(**(TINY_COMMON | dict(intermediate_size=64)),
                                   **(gemma4 | dict(layer_types=["sliding_attention",
                                                                 "full_attention"] * 2)),
                                   num_hidden_layers=4, attention_k_eq_v=True,
                                   num_global_key_value_heads=1, hidden_size_per_layer_input=0,
                                   enable_moe_block=True, num_experts=8, top_k_experts=2,
                                   moe_intermediate_size=64)  # fmt: skip
    # Hybrid linear attention: three Gated DeltaNet layers to one of gated attention, each key
    # head shared by two value heads, RoPE over half of each head.
    linear = dict(num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)  # fmt: skip
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if arch == "qwen3_5":
        return tf.Qwen3_5TextConfig(**TINY_COMMON, **linear, rope_parameters=rope)
    if arch == "qwen3_5_moe":  # every layer's MLP experts (top-2 of 8) and a shared expert
        return tf.Qwen3_5MoeTextConfig(**TINY_COMMON, **linear, rope_parameters=rope,
                                       num_experts=8, num_experts_per_tok=2,
                                       moe_intermediate_size=64,
                                       shared_expert_intermediate_size=64)  # fmt: skip
    if arch == "qwen3_next":  # its experts: top-2 of 8 with a shared expert, one dense layer
        return tf.Qwen3NextConfig(**TINY_COMMON, **linear, rope_parameters=rope, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=64,
                                  shared_expert_intermediate_size=64, mlp_only_layers=[1])  # fmt: skip
    # Mixtures of experts: 8 experts of width 64 (the C kernels' rows are multiples of 64),
    # top-2 (Qwen2-MoE top-4 with a shared expert and a dense layer; Qwen3-MoE a dense layer
    # by decoder_sparse_step; OLMoE experts of TINY_COMMON's width).
    moe = dict(num_hidden_layers=2, num_experts_per_tok=2)
    if arch == "mixtral":
        return tf.MixtralConfig(
            **(TINY_COMMON | dict(intermediate_size=64)), **moe, num_local_experts=8
        )
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **TINY_COMMON,
            **(moe | dict(num_hidden_layers=3, num_experts_per_tok=4)),
            num_experts=8,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            mlp_only_layers=[1],
            norm_topk_prob=False,
        )
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **TINY_COMMON,
            **(moe | dict(num_hidden_layers=3)),
            num_experts=8,
            moe_intermediate_size=64,
            decoder_sparse_step=2,
            norm_topk_prob=True,
        )
    if arch == "olmoe":
        return tf.OlmoeConfig(**TINY_COMMON, **moe, num_experts=8, norm_topk_prob=False)
    if arch == "gpt_oss":  # YaRN over a 64-token original context; a low clamp that bites
        yarn = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}  # fmt: skip
        return tf.GptOssConfig(**(TINY_COMMON | dict(intermediate_size=64)), **moe,
                               num_local_experts=8, sliding_window=24, swiglu_limit=0.1,
                               rope_parameters=yarn)  # fmt: skip
    raise ValueError(arch)


_CACHE: dict[str, Path] = {}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_model_dir("llama")`` -> a HF directory with random weights (built once per run)."""

    def make(arch: str) -> Path:
        if arch not in _CACHE:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            config = _tiny_hf_config(arch)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            # Random init is small; widen it so logits differ clearly between tokens.
            with torch.no_grad():
                for p in model.parameters():
                    p.normal_(0.0, 0.2 if p.dim() > 1 else 0.1)
                if arch.startswith("gemma4"):  # gains near 1, not 0; layer scalars that matter
                    for name, p in model.named_parameters():
                        if (p.dim() == 1 and "norm" in name) or name.endswith("scale"):
                            p.add_(1.0)
                    for name, b in model.named_buffers():
                        if name.endswith("layer_scalar"):
                            b.uniform_(0.5, 1.5)
            path = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(path, safe_serialization=True)
            write_byte_tokenizer(path, config.vocab_size)
            _CACHE[arch] = path
        return _CACHE[arch]

    return make


@pytest.fixture(scope="session")
def reasoning_model_dir(tiny_model_dir, tmp_path_factory) -> Callable[[str], Path]:
    """``reasoning_model_dir("qwen3")`` / ``("deepseek_r1")``: the tiny random Qwen3 with that
    family's chat template and its tags as single tokens (tests/reasoning_templates.py)."""
    import json
    import shutil

    from reasoning_templates import DEEPSEEK_R1, DEEPSEEK_R1_TOKENS, QWEN3, QWEN3_TOKENS

    made: dict[str, Path] = {}

    def make(kind: str) -> Path:
        if kind not in made:
            template, tokens, special, eos = {
                "qwen3": (QWEN3, QWEN3_TOKENS, QWEN3_TOKENS[:2], "<|im_end|>"),
                "deepseek_r1": (
                    DEEPSEEK_R1,
                    DEEPSEEK_R1_TOKENS,
                    DEEPSEEK_R1_TOKENS[:3],
                    "<｜end▁of▁sentence｜>",
                ),
            }[kind]
            path = tmp_path_factory.mktemp(f"tiny-{kind}-reasoning")
            source = tiny_model_dir("qwen3")
            shutil.copy(source / "model.safetensors", path / "model.safetensors")
            config = json.loads((source / "config.json").read_text())
            # Room for Qwen3's tool prompt, ~550 of the byte tokenizer's tokens.
            config["max_position_embeddings"] = 2048
            (path / "config.json").write_text(json.dumps(config))
            # The chat format's own tokens are special, the thinking and tool tags are not (as
            # in the real tokenizers); the end of a turn is the end of sequence.
            write_byte_tokenizer(path, 384, tokens, template, eos, special)
            made[kind] = path
        return made[kind]

    return make


# harmony's special tokens (gpt-oss's), and a compact template in its format (not gpt-oss's own,
# which the real checkpoints ship): a system turn, the tools, history with thinking and calls.
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>",
                  "<|return|>", "<|call|>")  # fmt: skip
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}\n"
    "# Valid channels: analysis, commentary, final.<|end|>"
    "{% if tools %}<|start|>developer<|message|># Tools\n{% for t in tools %}"
    "{{ t.function.name }}{% endfor %}<|end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "{% if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}"
    "<|end|>{% endif %}<|start|>assistant to=functions.{{ m.tool_calls[0].function.name }}"
    "<|channel|>commentary json<|message|>{{ m.tool_calls[0].function.arguments | tojson }}"
    "<|call|>{% elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
    "{{ m.content }}<|end|>{% elif m.role == 'tool' %}<|start|>functions to=assistant"
    "<|channel|>commentary<|message|>{{ m.content | tojson }}<|end|>{% else %}"
    "<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


@pytest.fixture(scope="session")
def harmony_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny random gpt-oss with harmony's tokens (special, as gpt-oss's are) and a
    harmony template; ``<|return|>`` ends a sequence."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("tiny-harmony")
    source = tiny_model_dir("gpt_oss")
    shutil.copy(source / "model.safetensors", path / "model.safetensors")
    write_byte_tokenizer(path, 384, HARMONY_TOKENS, HARMONY_TEMPLATE, "<|return|>",
                         HARMONY_TOKENS)  # fmt: skip
    config = json.loads((source / "config.json").read_text())
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    # gpt-oss's ends of generation: <|return|> (answered) and <|call|> (a tool call).
    config["eos_token_id"] = [vocab["<|return|>"], vocab["<|call|>"]]
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def embedding_model_dir(tiny_model_dir, tmp_path_factory) -> Callable[..., Path]:
    """``embedding_model_dir("mean", normalize=True)``: the tiny random Qwen3 with
    sentence-transformers' files (modules.json, a Pooling module by that method, a Normalize
    module), as Qwen3-Embedding ships them ("last")."""
    import json
    import shutil

    modes = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
             "cls": "pooling_mode_cls_token"}  # fmt: skip
    made: dict[tuple[str, bool], Path] = {}

    def make(method: str, normalize: bool = True) -> Path:
        if (method, normalize) not in made:
            from transformers import AutoModel

            path = tmp_path_factory.mktemp(f"tiny-embed-{method}")
            source = tiny_model_dir("qwen3")
            # Saved as the base model (Qwen3Model: tensors without "model.", no head), its
            # input embedding tied as the head, as Qwen3-Embedding-0.6B is.
            base = AutoModel.from_pretrained(source, dtype=torch.float32)
            base.config.tie_word_embeddings = True
            base.save_pretrained(path, safe_serialization=True)
            for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                if (source / name).exists():
                    shutil.copy(source / name, path / name)
            modules = [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]  # fmt: skip
            if normalize:
                modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                                "type": "sentence_transformers.models.Normalize"})  # fmt: skip
            (path / "modules.json").write_text(json.dumps(modules))
            (path / "1_Pooling").mkdir()
            config = {
                "word_embedding_dimension": 64,
                **{m: m == modes[method] for m in modes.values()},
            }
            (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
            made[(method, normalize)] = path
        return made[(method, normalize)]

    return make


def assert_all_blocks_free(engine) -> None:
    """Every engine test ends with this: no request holds a KV block (nor, in a hybrid
    model, a recurrent-state slot)."""
    stats = engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    assert engine.num_free_blocks == engine.num_total_blocks
    # (A core in its own process keeps its runner there.)
    runner = getattr(getattr(getattr(engine, "executor", None), "worker", None), "runner", None)
    if runner is not None and runner.recurrent is not None:
        assert runner.recurrent.num_free == engine.config.scheduler_config.max_num_seqs


def fail_steps_after(engine, num_ok: int) -> list[int]:
    """Make ``engine.step`` raise RuntimeError("boom") from its call ``num_ok + 1`` on (an
    engine bug); the returned one-item list counts its calls."""
    step, calls = engine.step, [0]

    def failing_step(unread=()):
        calls[0] += 1
        if calls[0] > num_ok:
            raise RuntimeError("boom")
        return step(unread)

    engine.step = failing_step
    return calls


def run_to_end(engine, items: list) -> list:
    """Adds every (prompt, SamplingParams) of ``items``, steps until none is left; the final
    RequestOutputs in input order. Each request finishes once, and no block stays held."""
    ids = [engine.add_request(prompt, params) for prompt, params in items]
    done: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in done
            if out.finished:
                done[out.request_id] = out
    assert_all_blocks_free(engine)
    return [done[rid] for rid in ids]


def random_prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 5-40 tokens (<s> then byte tokens of the tiny models' tokenizer)."""
    rng = random.Random(seed)
    return [[1] + [rng.randrange(3, 259) for _ in range(rng.randrange(4, 40))] for _ in range(n)]
