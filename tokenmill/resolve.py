"""Which model a name stands for: ``resolve_model`` turns what a user typed (an embedded model's
name, a path, an alias, a file in the model directory) into a ModelSource."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenmill.embedded import EMBEDDED_MODELS, embedded_path
from tokenmill.recipes import recipes
from tokenmill.store import aliases, model_dir


@dataclass(frozen=True, slots=True)
class ModelSource:
    """Where weights and tokenizer come from: a GGUF file or a Hugging Face directory."""

    path: Path
    format: str  # "gguf" | "hf"


def resolve_model(spec: str, _depth: int = 0) -> ModelSource:
    """Turn a model name into a ModelSource: an embedded model's name (embedded.py), a ``.gguf`` path or
    a Hugging Face directory, an alias of the model directory's aliases.toml, or the name of a
    file or directory in the model directory (``qwen2.5-0.5b-q4_k_m`` for its .gguf)."""
    if spec in EMBEDDED_MODELS:
        return ModelSource(embedded_path(spec), "gguf")
    created = recipes().get(spec.removesuffix(":latest")) if "/" not in spec else None
    if created is not None:  # a model made from a Modelfile runs its base's weights
        if _depth >= 8:
            raise ValueError(f"model {spec!r}: its FROM chain is longer than 8 (a loop?)")
        return resolve_model(created.base, _depth + 1)
    path = Path(spec).expanduser()
    if not path.exists() and spec:
        directory = model_dir()
        named = aliases(directory).get(spec)
        if named is not None and not named.exists():
            raise ValueError(f"alias {spec!r} ({directory / 'aliases.toml'}) names {named}, "
                             "which does not exist")  # fmt: skip
        candidates = (
            [named] if named is not None else [directory / spec, directory / f"{spec}.gguf"]
        )
        path = next((p for p in candidates if p is not None and p.exists()), path)
    if path.is_file():
        with path.open("rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"model {spec!r} is not a GGUF file (no GGUF magic at its start)")
        return ModelSource(path, "gguf")
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ValueError(f"model directory {spec!r} has no config.json")
        return ModelSource(path, "hf")
    raise ValueError(
        f"unknown model {spec!r}: give an embedded model ({', '.join(EMBEDDED_MODELS)}), a path "
        "to a .gguf file, a Hugging Face model directory, or a name `tokenmill models` lists"
    )
