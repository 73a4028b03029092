"""Architecture -> model class (tokenmill/architectures.py's rows), imported lazily so only the
needed file loads."""

from __future__ import annotations

import importlib

from tokenmill.architectures import BY_NAME, SUPPORTED_ARCHITECTURES
from tokenmill.models.base import CausalLM


def get_model_class(architecture: str) -> type[CausalLM]:
    if architecture not in BY_NAME:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    module_name, _, class_name = BY_NAME[architecture].model_class.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
