"""A streamed run's SSE chunk events: the run's fixed frame around one choice.

A stream writes a chunk per delta, for each of hundreds of streams a step, on the event loop
whose thread shares the GIL with the engine's. Building and dumping the pydantic chunk costs
~4.7 us (AMD EPYC Zen 4). The frame (id, object, created, model; ``usage: null`` where the
client asked for usage) is the same in all of a run's chunks, so pydantic serializes it once.
Each chunk then adds its choice. The common choice, plain JSON values and the model's defaults
(a text delta), goes through the json module (~2.5 us a chunk), the others through pydantic.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

_EMPTY_CHOICES = '"choices":[]'
# As pydantic writes JSON: no spaces, non-ASCII characters as they are.
_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class ChunkFrame:
    """The chunk events of one run: ``chunk_cls`` (a model with ``choices``, ``usage`` and
    ``timings``) around one ``choice_cls`` each."""

    def __init__(
        self,
        chunk_cls: type[BaseModel],
        choice_cls: type[BaseModel],
        request_id: str,
        created: int,
        model: str,
        include_usage: bool,
    ) -> None:
        exclude = {"timings"} if include_usage else {"timings", "usage"}
        empty = chunk_cls(id=request_id, created=created, model=model, choices=[])
        head, tail = empty.model_dump_json(exclude=exclude).split(_EMPTY_CHOICES)
        self._head = f'data: {head}"choices":['
        self._tail = f"]{tail}\n\n"
        self._choice_cls = choice_cls
        # The choice's fields in order, at their defaults (required ones: given each time).
        self._defaults = {
            name: None if f.is_required() else f.get_default(call_default_factory=True)
            for name, f in choice_cls.model_fields.items()
        }

    def event(self, choice: BaseModel) -> str:
        """The chunk event of one choice."""
        return f"{self._head}{choice.model_dump_json()}{self._tail}"

    def plain_event(self, **values: Any) -> str:
        """The chunk event of ``choice_cls(**values)``, without building it: ``values`` must be
        what the model keeps as it is (str, int, None; dicts and lists of them), and the other
        fields take their defaults."""
        fields = self._defaults | values
        if len(fields) != len(self._defaults):
            unknown = sorted(set(values) - set(self._defaults))
            raise ValueError(f"{self._choice_cls.__name__} has no fields {unknown}")
        return f"{self._head}{_dumps(fields)}{self._tail}"
