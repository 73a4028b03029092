"""Running the host under uvicorn: SIGTERM (or SIGINT) stops it listening, and its lifespan
stops every runner (each drains its requests as a lone server does); exit status 0."""

from __future__ import annotations

import logging

from tokenmill.host.app import create_app
from tokenmill.host.config import HostConfig
from tokenmill.memory import human_bytes
from tokenmill.router.launcher import light_server

logger = logging.getLogger(__name__)


def run_host(config: HostConfig, log_level: str = "info") -> int:
    """Serve every model here until SIGTERM / SIGINT; returns the exit status."""
    server = light_server(
        create_app(config), config.host, config.port, log_level, config.access_log,
        graceful_timeout=config.stop_timeout,
    )  # fmt: skip
    keep = "forever" if config.keep_alive is None else f"{config.keep_alive:g} s"
    logger.info(
        "serving every model here at http://%s:%d/v1 (each loads on its first request; at "
        "most %d loaded, within %s; idle ones unload after %s)",
        config.host, config.port, config.max_loaded_models,
        human_bytes(config.memory_budget), keep,
    )  # fmt: skip
    server.run()
    return 0
