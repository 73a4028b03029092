"""The ``tokenmill router`` command line (no heavy imports: the CLI builds it for --help)."""

from __future__ import annotations

import argparse

from tokenmill.router.config import RouterConfig


def add_router_parser(sub: argparse._SubParsersAction) -> None:
    d = RouterConfig(replica_urls=("http://-",))
    p = sub.add_parser(
        "router",
        help="OpenAI-compatible front that routes requests to tokenmill replicas by prefix",
    )
    p.add_argument(
        "--replica",
        action="append",
        required=True,
        metavar="URL",
        help="base URL of a tokenmill server, e.g. http://127.0.0.1:8001 (repeatable)",
    )
    p.add_argument("--host", default=d.host, help=f"address to bind (default: {d.host})")
    p.add_argument("--port", type=int, default=d.port, help=f"port (default: {d.port})")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="key the router accepts (repeatable; default: none needed). The client's "
        "Authorization header goes on to the replicas either way",
    )
    p.add_argument(
        "--metrics-public", action="store_true",
        help="serve /metrics without a key (for a Prometheus scraper that sends none)",
    )  # fmt: skip
    p.add_argument(
        "--health-interval",
        type=float,
        default=d.health_interval,
        help=f"seconds between health checks of each replica (default: {d.health_interval:g})",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help=f"larger request bodies get 413 (default: {d.max_body_bytes})",
    )
    p.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=d.access_log,
        help="log every HTTP request",
    )  # fmt: skip


def run_router_command(ns: argparse.Namespace, log_level: str) -> int:
    from tokenmill.router.launcher import run_router

    config = RouterConfig(
        replica_urls=tuple(ns.replica),
        host=ns.host,
        port=ns.port,
        api_keys=tuple(ns.api_key),
        metrics_public=ns.metrics_public,
        health_interval=ns.health_interval,
        max_body_bytes=ns.max_body_bytes,
        access_log=ns.access_log,
    )
    return run_router(config, log_level)
