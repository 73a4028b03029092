"""The models tokenmill can run by name: the embedded ones, the aliases of the model
directory's aliases.toml, and the GGUF files and Hugging Face directories in it, each
summarized from its headers (modelfile.py) without loading it. ``tokenmill models`` prints
them; a server without a pinned model serves them (host/).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenmill.embedded import EMBEDDED_MODELS, embedded_path
from tokenmill.modelfile import ModelSummary, summarize
from tokenmill.recipes import recipes
from tokenmill.resolve import resolve_model
from tokenmill.store import aliases, model_dir, model_files

# How long a request waited for its model to load (seconds), from the host (host/) to the
# model's runner, which reports it as Ollama's ``load_duration``.
LOAD_DURATION_HEADER = "X-Tokenmill-Load-Duration"


@dataclass(slots=True)
class Entry:
    name: str
    path: Path | None
    summary: ModelSummary | None
    error: str | None = None
    created: bool = False  # made from a Modelfile (recipes.py): its path is its base's


def catalog(directory: Path | None = None) -> list[Entry]:
    """Every model ``tokenmill models`` lists, each summarized (or with why it cannot be)."""
    directory = directory or model_dir()
    entries: list[Entry] = []
    seen: set[Path] = set()

    def add(name: str, resolve: Callable[[], Path], created: bool = False) -> None:
        try:
            path = Path(resolve()).resolve()
        except (ValueError, ImportError, OSError) as e:
            entries.append(Entry(name, None, None, str(e), created))
            return
        if path in seen and not created:
            return
        if not created:  # a created model's base is listed under its own name too
            seen.add(path)
        try:
            entries.append(Entry(name, path, summarize(path), None, created))
        except ValueError as e:
            entries.append(Entry(name, path, None, str(e), created))

    for name in EMBEDDED_MODELS:  # listing fetches nothing
        add(name, lambda name=name: embedded_path(name, fetch=False))
    try:
        named = aliases(directory)
    except ValueError as e:
        entries.append(Entry("aliases.toml", directory / "aliases.toml", None, str(e)))
        named = {}
    for name, path in named.items():
        add(name, lambda path=path: path)
    for path in model_files(directory):
        add(path.stem if path.suffix == ".gguf" else path.name, lambda path=path: path)
    try:
        created = recipes(directory)
    except ValueError as e:
        entries.append(Entry("aliases.toml", directory / "aliases.toml", None, str(e)))
        created = {}
    for name, recipe in created.items():
        add(name, lambda base=recipe.base: _base_path(base), created=True)
    return entries


def parameter_size(n: int) -> str:
    """Ollama's spelling of a parameter count: "268.1M", "7.2B"."""
    if n >= 1e9:
        return f"{n / 1e9:.1f}B"
    return f"{n / 1e6:.1f}M"


def _base_path(base: str) -> Path:
    """A created model's weights, found without fetching (listing fetches nothing)."""
    if base in EMBEDDED_MODELS:
        return embedded_path(base, fetch=False)
    return resolve_model(base).path
