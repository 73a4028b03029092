"""Where a request goes: a consistent hash of its prompt's first blocks, with a load fallback.

Pure functions, no I/O. The router has no tokenizer, so "blocks" are of characters:

- A request's text is its ``prompt`` (Ollama's ``system`` before it), or its chat ``messages``
  serialized canonically as ``role\\ncontent\\n\\n`` each (content parts' texts joined).
- Its key is the first ``min(len // BLOCK_CHARS, PREFIX_CHARS // BLOCK_CHARS)`` whole blocks
  of ``BLOCK_CHARS`` characters (at most the first 256 characters); a text shorter than one
  block is its own key. A ``cache_salt`` is part of the key (a salted prefix is a different
  cache entry on the replica).
- The key ranks the replicas by rendezvous (highest random weight) hashing: the score of a
  replica is blake2b(url, key), so the ranking depends on the URLs, not their order, and
  removing a replica moves only the keys it ranked first (each to its next replica).
- The request goes to the key's first healthy replica (reason ``prefix_hit`` when that is
  its first replica of all, ``next_healthy`` when the first is down), unless that replica is
  overloaded: more in flight than ``LOAD_FACTOR`` x the least-loaded healthy replica's
  plus ``LOAD_SLACK``. Then, and for requests without a text, it goes to the least-loaded
  healthy replica (``fallback``; ties go to the key's better-ranked replica).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PREFIX_CHARS = 256
BLOCK_CHARS = 64
LOAD_FACTOR = 2
LOAD_SLACK = 8


class Reason(enum.Enum):
    """Why a request went where it went (a label of the router's routing metric)."""

    PREFIX_HIT = "prefix_hit"
    NEXT_HEALTHY = "next_healthy"
    FALLBACK = "fallback"
    RETRY = "retry"


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What routing needs to know of a replica."""

    url: str
    healthy: bool = True
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    replica_idx: int
    reason: Reason


def request_text(body: Mapping[str, Any]) -> str | None:
    """The text a request's prefix is read from: chat messages or the prompt (None: neither)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return canonical_messages(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        # A batch of prompts routes by its first; a token-id prompt by its ids as text.
        first = prompt[0]
        prompt = first if isinstance(first, (str, list)) else prompt
        if isinstance(prompt, list):
            prompt = ",".join(str(t) for t in prompt)
    if not isinstance(prompt, str):
        return None
    system = body.get("system")
    return f"{system}\n\n{prompt}" if isinstance(system, str) and system else prompt


def canonical_messages(messages: Sequence[Any]) -> str:
    """``role\\ncontent\\n\\n`` per message; list contents contribute their parts' texts."""
    parts = []
    for message in messages:
        if not isinstance(message, Mapping):
            parts.append(f"{message!r}\n\n")
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        parts.append(f"{message.get('role', '')}\n{content or ''}\n\n")
    return "".join(parts)


def prefix_key(text: str, salt: str | None = None) -> str:
    """The first whole blocks of ``text`` (at most PREFIX_CHARS characters), salted."""
    num_blocks = min(len(text) // BLOCK_CHARS, PREFIX_CHARS // BLOCK_CHARS)
    key = text[: num_blocks * BLOCK_CHARS] if num_blocks else text
    return f"{salt}\0{key}" if salt else key


def request_key(body: Mapping[str, Any]) -> str | None:
    text = request_text(body)
    if text is None:
        return None
    salt = body.get("cache_salt")
    return prefix_key(text, salt if isinstance(salt, str) else None)


def score(key: str, url: str) -> int:
    digest = hashlib.blake2b(f"{url}\0{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rank(key: str, urls: Sequence[str]) -> list[int]:
    """Replica indices, the key's first choice first (rendezvous hashing)."""
    return sorted(range(len(urls)), key=lambda i: (-score(key, urls[i]), urls[i]))


def is_overloaded(in_flight: int, least_in_flight: int) -> bool:
    return in_flight > LOAD_FACTOR * least_in_flight + LOAD_SLACK


def choose(
    key: str | None, replicas: Sequence[ReplicaView], exclude: Collection[int] = ()
) -> Decision | None:
    """The replica for a request with prefix key ``key`` (None: no healthy replica left)."""
    candidates = [i for i, r in enumerate(replicas) if r.healthy and i not in exclude]
    if not candidates:
        return None
    if key is None:
        return Decision(min(candidates, key=lambda i: (replicas[i].in_flight, i)), Reason.FALLBACK)
    order = rank(key, [r.url for r in replicas])
    position = {idx: pos for pos, idx in enumerate(order)}
    candidates.sort(key=position.__getitem__)
    chosen = candidates[0]
    least = min(candidates, key=lambda i: (replicas[i].in_flight, position[i]))
    if is_overloaded(replicas[chosen].in_flight, replicas[least].in_flight):
        return Decision(least, Reason.FALLBACK)
    return Decision(chosen, Reason.PREFIX_HIT if chosen == order[0] else Reason.NEXT_HEALTHY)
