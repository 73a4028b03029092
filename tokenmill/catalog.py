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
from tokenmill.store import aliases, model_dir, model_files


@dataclass(slots=True)
class Entry:
    name: str
    path: Path | None
    summary: ModelSummary | None
    error: str | None = None


def catalog(directory: Path | None = None) -> list[Entry]:
    """Every model ``tokenmill models`` lists, each summarized (or with why it cannot be)."""
    directory = directory or model_dir()
    entries: list[Entry] = []
    seen: set[Path] = set()

    def add(name: str, resolve: Callable[[], Path]) -> None:
        try:
            path = Path(resolve()).resolve()
        except (ValueError, ImportError, OSError) as e:
            entries.append(Entry(name, None, None, str(e)))
            return
        if path in seen:
            return
        seen.add(path)
        try:
            entries.append(Entry(name, path, summarize(path)))
        except ValueError as e:
            entries.append(Entry(name, path, None, str(e)))

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
    return entries
