"""Per-key rate limits: requests and tokens per minute over a sliding 60 s window.

A key may start a request while it has started fewer than ``rpm`` in the last 60 s and used
fewer than ``tpm`` tokens (prompt + completion, counted when a request is metered). Beyond
either, 429 with ``Retry-After``: the whole seconds until the window has room again. The
admin key is not limited. Only the event loop touches a limiter.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from tokenmill.server.errors import APIError

WINDOW_S = 60.0


class RateLimiter:
    def __init__(
        self,
        rpm: int | None,
        tpm: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rpm = rpm
        self.tpm = tpm
        self._clock = clock
        self._requests: dict[str, deque[float]] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}
        self._num_tokens: dict[str, int] = {}

    @property
    def is_enabled(self) -> bool:
        return self.rpm is not None or self.tpm is not None

    def admit(self, key_id: str) -> None:
        """Count a request of ``key_id``, or raise 429 if it is over a limit."""
        if not self.is_enabled:
            return
        now = self._clock()
        self._expire(key_id, now)
        starts = self._requests.setdefault(key_id, deque())
        if self.rpm is not None and len(starts) >= self.rpm:
            wait = starts[0] + WINDOW_S - now
            raise _limited(
                f"rate limit reached: {len(starts)} requests in the last minute, the limit "
                f"of this key is {self.rpm} a minute",
                wait,
                "requests",
            )
        used = self._num_tokens.get(key_id, 0)
        if self.tpm is not None and used >= self.tpm:
            raise _limited(
                f"rate limit reached: {used} tokens in the last minute, the limit of this "
                f"key is {self.tpm} a minute",
                self._token_wait(key_id, now),
                "tokens",
            )
        starts.append(now)

    def add_tokens(self, key_id: str, num_tokens: int) -> None:
        """Count the tokens of a metered request of ``key_id``."""
        if self.tpm is None or num_tokens <= 0:
            return
        self._tokens.setdefault(key_id, deque()).append((self._clock(), num_tokens))
        self._num_tokens[key_id] = self._num_tokens.get(key_id, 0) + num_tokens

    def _expire(self, key_id: str, now: float) -> None:
        starts = self._requests.get(key_id)
        while starts and starts[0] <= now - WINDOW_S:
            starts.popleft()
        tokens = self._tokens.get(key_id)
        while tokens and tokens[0][0] <= now - WINDOW_S:
            self._num_tokens[key_id] -= tokens.popleft()[1]

    def _token_wait(self, key_id: str, now: float) -> float:
        """Seconds until the tokens in the window drop below the limit."""
        assert self.tpm is not None
        used = self._num_tokens[key_id]
        for when, num in self._tokens[key_id]:
            used -= num
            if used < self.tpm:
                return when + WINDOW_S - now
        return WINDOW_S


def _limited(message: str, wait: float, kind: str) -> APIError:
    retry_after = max(1, math.ceil(wait))
    return APIError(
        429,
        f"{message}; retry after {retry_after} s",
        code=f"rate_limit_{kind}",
        headers={"Retry-After": str(retry_after)},
    )
