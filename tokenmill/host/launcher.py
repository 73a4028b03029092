"""Running the host under uvicorn: SIGTERM (or SIGINT) stops it listening, and its lifespan
stops every runner (each drains its requests as a lone server does); exit status 0."""

from __future__ import annotations

import logging

import uvicorn

from tokenmill.host.app import create_app
from tokenmill.host.config import HostConfig
from tokenmill.memory import human_bytes
from tokenmill.router.launcher import RouterServer

logger = logging.getLogger(__name__)


def run_host(config: HostConfig, log_level: str = "info") -> int:
    """Serve every model here until SIGTERM / SIGINT; returns the exit status."""
    app = create_app(config)
    # httpx logs every request at INFO: one line per proxied request and health poll.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    server = RouterServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,
            log_level=log_level,
            access_log=config.access_log,
            lifespan="on",
            timeout_graceful_shutdown=int(config.stop_timeout),
        )
    )
    keep = "forever" if config.keep_alive is None else f"{config.keep_alive:g} s"
    logger.info(
        "serving every model here at http://%s:%d/v1 (each loads on its first request; at "
        "most %d loaded, within %s; idle ones unload after %s)",
        config.host, config.port, config.max_loaded_models,
        human_bytes(config.memory_budget), keep,
    )  # fmt: skip
    server.run()
    return 0
