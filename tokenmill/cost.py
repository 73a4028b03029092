"""What tokens cost: the one definition the benchmark, the planner and the server's dashboard share.

Hardware billed by the hour costs, per million tokens, its price per hour divided by the tokens
it makes in that hour, times a million. Metered usage priced per million tokens costs its token
counts times those prices.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TokenPrices", "cost_per_million_tokens"]


def cost_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float | None:
    """USD per million tokens for hardware at ``price_per_hour`` USD making ``tokens_per_s``.

    None when nothing was made (the cost is unbounded, not zero).
    """
    if price_per_hour < 0:
        raise ValueError(f"price per hour must be >= 0, got {price_per_hour}")
    if tokens_per_s <= 0:
        return None
    return price_per_hour / (tokens_per_s * 3600.0) * 1e6


@dataclass(frozen=True, slots=True)
class TokenPrices:
    """USD per million prompt (input) and completion (output) tokens; cached prompt tokens may
    be priced apart (None: as other prompt tokens)."""

    input_per_million: float = 0.0
    output_per_million: float = 0.0
    cached_input_per_million: float | None = None

    def __post_init__(self) -> None:
        for name in ("input_per_million", "output_per_million", "cached_input_per_million"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")

    def cost(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> float:
        """USD for one request's (or a sum of requests') usage."""
        cached_price = (
            self.input_per_million
            if self.cached_input_per_million is None
            else self.cached_input_per_million
        )
        uncached = prompt_tokens - cached_tokens
        return (
            uncached * self.input_per_million
            + cached_tokens * cached_price
            + completion_tokens * self.output_per_million
        ) / 1e6
