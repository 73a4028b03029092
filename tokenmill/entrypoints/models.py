"""``tokenmill models`` and ``tokenmill show``: what models are here, and what one holds and
would take to run, read from the files' headers (tokenmill/modelfile.py) without loading them.

``models`` lists the embedded default, the aliases of the model directory's aliases.toml and
the GGUF files and Hugging Face directories in it (``--model-dir``, default
~/.cache/tokenmill/models). ``show`` prints one model's metadata, chat template, tokenizer and
the memory it would take here: its weights as tokenmill keeps them and the float32 KV cache at a
context length.
"""

from __future__ import annotations

from pathlib import Path
from typing import TextIO

from tokenmill.architectures import CHECKPOINT_NAMES, SUPPORTED_ARCHITECTURES
from tokenmill.catalog import Entry, catalog
from tokenmill.memory import available_memory, human_bytes
from tokenmill.modelfile import summarize
from tokenmill.resolve import resolve_model
from tokenmill.store import PACKED_CACHE_ENTRIES, cache_dir, model_dir


def print_models(out: TextIO, directory: Path | None = None) -> None:
    directory = directory or model_dir()
    rows = [("NAME", "ARCHITECTURE", "PARAMS", "TYPE", "CONTEXT", "SIZE", "PATH")]
    for e in catalog(directory):
        s = e.summary
        if s is None:
            rows.append((e.name, "-", "-", "-", "-", "-", f"{e.path or ''}  ({e.error})"))
            continue
        arch = (
            s.architecture
            if s.architecture in CHECKPOINT_NAMES
            else f"{s.architecture} (unsupported)"
        )
        rows.append(
            (
                e.name,
                arch,
                _count(s.num_parameters),
                s.file_type or "-",
                str(s.context_length or "-"),
                human_bytes(s.file_bytes),
                str(s.path),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] + "\n")
    out.write(f"\nmodel directory: {directory}\n")
    out.write(packed_cache_line() + "\n")


def packed_cache_line() -> str:
    """One line on the packed-model cache (models/gguf_cache.py): its entries, their bytes and
    how to remove them or turn it off."""
    directory = cache_dir("packed")
    if directory is None:
        return "packed-model cache: off (TOKENMILL_NO_CACHE)"
    entries = sorted(directory.glob("*.pt")) if directory.is_dir() else []
    size = human_bytes(sum(p.stat().st_size for p in entries))
    return (
        f"packed-model cache: {len(entries)} entries, {size} in {directory} (at most "
        f"{PACKED_CACHE_ENTRIES}, the least recently used go first; remove the directory to "
        f"clear it, TOKENMILL_NO_CACHE=1 to turn it off)"
    )


def print_show(out: TextIO, spec: str, context: int | None = None) -> None:
    """ValueError for a model that cannot be found or read."""
    s = summarize(resolve_model(spec).path)
    ctx = min(context or s.context_length or 4096, s.context_length or context or 4096)
    runnable = s.architecture in CHECKPOINT_NAMES
    lines = [
        f"model         {spec}",
        f"path          {s.path}",
        f"format        {'GGUF' if s.format == 'gguf' else 'Hugging Face directory'}",
        f"architecture  {s.architecture}"
        + (
            ""
            if runnable
            else f"  (not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        ),
        f"parameters    {_count(s.num_parameters)} ({s.num_parameters:,})"
        + (f"; {s.num_experts} experts, {s.experts_used} a token" if s.num_experts else ""),
        f"type          {s.file_type or '-'}",
        f"context       {s.context_length}",
        f"file size     {human_bytes(s.file_bytes)}",
        f"tokenizer     {s.tokenizer}",
        "tensor types  "
        + ", ".join(
            f"{t} {n / s.num_parameters:.1%}"
            for t, n in sorted(s.parameters_by_type.items(), key=lambda kv: -kv[1])
        ),
        "",
        "memory here (weights as tokenmill keeps them, float32 KV cache):",
        f"  weights     {human_bytes(s.weight_bytes_estimate)}",
        f"  KV cache    {human_bytes(s.kv_bytes_per_token * ctx)} at {ctx} tokens "
        f"({human_bytes(s.kv_bytes_per_token)} a token)",
    ]
    if s.state_bytes_per_request:
        lines.append(f"  state       {human_bytes(s.state_bytes_per_request)} a request "
                     "(linear-attention layers)")  # fmt: skip
    free = available_memory()
    if free is not None:
        need = s.weight_bytes_estimate + s.kv_bytes_per_token * ctx
        verdict = "fits" if need < free else "does NOT fit"
        lines.append(f"  available   {human_bytes(free)}: {verdict}")
    lines += ["", "metadata:"]
    for key, value in s.metadata.items():
        if key == "tokenizer.chat_template":
            continue
        text = repr(value) if not isinstance(value, str) else value
        lines.append(f"  {key} = {text if len(text) <= 100 else text[:97] + '...'}")
    lines += ["", "chat template:", s.chat_template or "  (none)"]
    out.write("\n".join(lines) + "\n")


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


__all__ = ["Entry", "catalog", "print_models", "print_show"]
