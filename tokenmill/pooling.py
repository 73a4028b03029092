"""Embeddings: how a model's hidden states become one vector per input (pooling).

An embedding request runs its prompt (prefill only, as any prompt runs: continuous batching,
chunked prefill) and, instead of sampling a token, pools the final hidden states (after the
model's last norm) of its positions:

- ``last``: the last token's (Qwen3-Embedding, e5-mistral: decoders read the whole input by
  their last position);
- ``mean``: the mean over all positions (sentence-transformers' default);
- ``cls``: the first token's (BERT-style [CLS]);

then, with ``normalize``, divides it by its L2 norm. A checkpoint says which: a Hugging Face
directory in its sentence-transformers files (``modules.json`` naming a Pooling module, whose
``config.json`` sets ``pooling_mode_*``, and a Normalize module), a GGUF in its
``{arch}.pooling_type`` (llama.cpp: 1 mean, 2 cls, 3 last). ``--task embed`` serves any model's
embeddings, by the checkpoint's pooling or else last-token with normalization (vLLM's default
for decoders).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenmill.modelfile import read_gguf

PoolingMethod = Literal["last", "mean", "cls"]
POOLING_METHODS: tuple[PoolingMethod, ...] = ("last", "mean", "cls")
TASKS = ("auto", "generate", "embed")
# llama.cpp's enum llama_pooling_type, as GGUFs store it.
_GGUF_POOLING: dict[int, PoolingMethod] = {1: "mean", 2: "cls", 3: "last"}
# sentence-transformers' Pooling config keys, by the method they turn on.
_ST_MODES: dict[str, PoolingMethod] = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}


@dataclass(frozen=True, slots=True)
class Pooling:
    """How an embedding request's hidden states become its vector."""

    method: PoolingMethod = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.method not in POOLING_METHODS:
            raise ValueError(
                f"pooling method must be one of {', '.join(POOLING_METHODS)}; got {self.method!r}"
            )

    @property
    def needs_every_position(self) -> bool:
        """Whether every prompt position must run (no prefix-cache hits): all but ``last``."""
        return self.method != "last"


def serving_pooling(task: str, model_path: Path | None) -> Pooling | None:
    """The pooling an engine serves embeddings with, or None when it generates: ``auto`` embeds
    when the checkpoint is an embedding model, ``embed`` always, ``generate`` never."""
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}; got {task!r}")
    if task == "generate":
        return None
    found = checkpoint_pooling(model_path) if model_path is not None else None
    if task == "embed":
        return found or Pooling()
    return found


def checkpoint_pooling(path: Path) -> Pooling | None:
    """The pooling a checkpoint declares (sentence-transformers files, a GGUF's pooling_type);
    None when it declares none (a generative model)."""
    if path.is_file():
        return _gguf_pooling(path)
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return None
    modules = json.loads(modules_file.read_text())
    method: PoolingMethod | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith(".Pooling"):
            config = json.loads((path / module.get("path", "") / "config.json").read_text())
            on = [m for key, m in _ST_MODES.items() if config.get(key)]
            others = [k for k, v in config.items() if k.startswith("pooling_mode_") and v]
            if len(on) != 1 or len(others) != 1:
                raise ValueError(
                    f"{modules_file}: the Pooling module sets {', '.join(others) or 'no mode'}; "
                    f"supported is exactly one of {', '.join(_ST_MODES)}"
                )
            method = on[0]
        elif kind.endswith(".Normalize"):
            normalize = True
    return Pooling(method, normalize) if method is not None else None


def _gguf_pooling(path: Path) -> Pooling | None:
    header = read_gguf(path, prefixes=("general.architecture",))
    arch = header.metadata.get("general.architecture", "")
    key = f"{arch}.pooling_type"
    value = read_gguf(path, prefixes=(key,)).metadata.get(key)
    method = _GGUF_POOLING.get(value) if isinstance(value, int) else None
    # llama.cpp normalizes embeddings by default (embd_normalize 2: Euclidean).
    return Pooling(method, True) if method is not None else None
