import pytest

from tokenmill.cost import TokenPrices, cost_per_million_tokens


def test_cost_per_million_tokens_is_price_over_tokens_per_hour():
    # 1000 tokens/s is 3.6M tokens an hour; at $3.60/h that is $1 per million.
    assert cost_per_million_tokens(3.6, 1000.0) == pytest.approx(1.0)
    assert cost_per_million_tokens(2.0, 50.0) == pytest.approx(2.0 / (50 * 3600) * 1e6)


def test_no_tokens_has_no_finite_cost_and_negative_prices_are_refused():
    assert cost_per_million_tokens(1.0, 0.0) is None
    with pytest.raises(ValueError, match="price per hour"):
        cost_per_million_tokens(-1.0, 10.0)
    with pytest.raises(ValueError, match="output_per_million"):
        TokenPrices(output_per_million=-0.5)


def test_token_prices_charge_cached_prompt_tokens_apart():
    prices = TokenPrices(
        input_per_million=1.0, output_per_million=4.0, cached_input_per_million=0.25
    )
    assert prices.cost(1_000_000, 500_000, cached_tokens=400_000) == pytest.approx(0.6 + 0.1 + 2.0)
    assert TokenPrices(1.0, 4.0).cost(1000, 10, cached_tokens=1000) == pytest.approx(
        0.001 + 0.00004
    )
