"""The host's /openapi.json: a runner's document (every route a model answers) with the
host's own operations added: creating, copying and deleting models (Ollama's)."""

from __future__ import annotations

import copy
from typing import Any

_ERROR = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
_STATUS = {"type": "object", "properties": {"status": {"type": "string"}}}


def _operation(summary: str, body: dict[str, Any], answer: dict[str, Any] | None) -> dict:
    ok: dict[str, Any] = {"description": "done"}
    if answer is not None:  # one object, or (stream, Ollama's default) NDJSON lines of them
        ok["content"] = {"application/json": {"schema": answer},
                         "application/x-ndjson": {"schema": {"type": "string"}}}  # fmt: skip
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "200": ok,
            "4XX": {"description": "refused", "content": {"application/json": {"schema": _ERROR}}},
        },
    }


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


_TEXT = {"type": "string"}
HOST_PATHS: dict[str, dict[str, Any]] = {
    "/api/create": {"post": _operation(
        "Ollama: name a model made from another (a Modelfile's fields, or its text)",
        _object({"model": _TEXT, "from": _TEXT, "system": _TEXT, "template": _TEXT,
                 "parameters": {"type": "object"}, "modelfile": _TEXT,
                 "messages": {"type": "array", "items": {"type": "object"}},
                 "stream": {"type": "boolean"}}, ["model"]),
        _STATUS,
    )},
    "/api/copy": {"post": _operation(
        "Ollama: name a model again", _object({"source": _TEXT, "destination": _TEXT},
                                              ["source", "destination"]), None,
    )},
    "/api/delete": {"delete": _operation(
        "Ollama: forget a created model or an alias (never a model's files)",
        _object({"model": _TEXT}, ["model"]), None,
    )},
}  # fmt: skip


def with_host_paths(document: dict[str, Any], default_model: str) -> dict[str, Any]:
    """A runner's OpenAPI document with the host's own operations in it, each with an example
    body (a fuzzer starts from them) made FROM ``default_model``."""
    merged = copy.deepcopy(document)
    paths = copy.deepcopy(HOST_PATHS)
    examples = {
        ("/api/create", "post"): {"model": "example-created", "from": default_model,
                                  "system": "Be brief.", "stream": False},
        ("/api/copy", "post"): {"source": default_model, "destination": "example-copy"},
        ("/api/delete", "delete"): {"model": "example-copy"},
    }  # fmt: skip
    for (path, method), example in examples.items():
        paths[path][method]["requestBody"]["content"]["application/json"]["example"] = example
    merged.setdefault("paths", {}).update(paths)
    return merged
