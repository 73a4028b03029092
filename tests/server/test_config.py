"""ServerConfig's checks of the metering, pricing and limit settings."""

from __future__ import annotations

import pytest

from tokenmill.cost import TokenPrices
from tokenmill.server.config import ServerConfig


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(api_keys=("k",), admin_api_key="k"), "must differ"),
        (dict(admin_api_key=""), "must not be an empty string"),
        (dict(usage_flush_interval=0), "usage_flush_interval must be > 0"),
        (dict(price_per_hour=-1.0), "price_per_hour must be >= 0"),
        (dict(rate_limit_rpm=0), "rate_limit_rpm must be >= 1"),
        (dict(rate_limit_tpm=-5), "rate_limit_tpm must be >= 1"),
        (dict(stats_window=0), "stats_window must be > 0"),
    ],
)
def test_bad_settings_are_refused(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        ServerConfig(served_model_name="m", **kwargs)


def test_prices_are_checked_by_token_prices() -> None:
    with pytest.raises(ValueError, match="output_per_million must be >= 0"):
        ServerConfig(served_model_name="m", prices=TokenPrices(output_per_million=-1))


def test_cli_refuses_an_unopenable_usage_db(tmp_path, capsys) -> None:
    from tokenmill.cli import main

    missing = tmp_path / "no" / "such" / "dir" / "usage.db"
    code = main(["serve", "--usage-db", str(missing), "--port", "0"])
    assert code == 2
    assert "cannot open the usage database" in capsys.readouterr().err
