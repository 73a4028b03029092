"""Per-key usage metering: what each API key (and each request's ``user``) used and cost,
kept in SQLite across restarts, counted in /metrics, and answered by GET /v1/usage.

One row per metered HTTP request (``UsageRecord``): the time it ended, its key id, user and
model, its prompt, cached prompt and completion tokens (the ``usage`` its client was sent, or
would have been: a stream without include_usage, a client that went away) and its cost at the
server's prices then (``tokenmill.cost.TokenPrices``). Requests that failed (4xx, an engine
error, aborted by the shutdown) are not metered.

Durability: records are appended on the event loop and written by a background thread every
``usage_flush_interval`` seconds, one transaction a batch, WAL journal. A clean shutdown
(SIGTERM, SIGINT) flushes after the drain, so it loses nothing; a SIGKILL loses at most the
records of the last flush interval. Reads (``report``) flush first, so they see every request
metered so far.
"""

from __future__ import annotations

import datetime
import logging
import re
import sqlite3
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from tokenmill.cost import TokenPrices
from tokenmill.server.auth import NO_KEY_ID, Caller, key_id_of
from tokenmill.server.errors import APIError, bad_request
from tokenmill.server.protocol import UsageBucket, UsageCounts, UsageReport

logger = logging.getLogger(__name__)

GROUP_BY = ("day", "key", "model", "user")
QUERY_PARAMS = ("key", "key_id", "user", "since", "until", "group_by")
_KEY_ID = re.compile(rf"^([0-9a-f]{{8}}|{NO_KEY_ID})$")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    ts REAL NOT NULL,                       -- unix time the request ended
    key_id TEXT NOT NULL,                   -- first 8 hex digits of sha256(key), or "none"
    user TEXT,                              -- the request's "user" field
    model TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    cached_prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    cost_usd REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS usage_key_ts ON usage (key_id, ts);
CREATE INDEX IF NOT EXISTS usage_ts ON usage (ts);
"""
_COLUMNS = {"day": "strftime('%Y-%m-%d', ts, 'unixepoch')", "key": "key_id", "model": "model",
            "user": "user"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One metered request."""

    time: float
    key_id: str
    user: str | None
    model: str
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    cost_usd: float


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """A checked GET /v1/usage: filters (None: any) and the grouping."""

    key_id: str | None = None
    user: str | None = None
    since: float | None = None
    until: float | None = None
    group_by: str | None = None


class UsageStore:
    """The SQLite table of usage rows; ``path`` None keeps it in memory. Thread-safe."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(path or ":memory:", check_same_thread=False)
            if path is not None:
                self._conn.execute("PRAGMA journal_mode=WAL")
                # In WAL mode a committed transaction survives a killed process.
                self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.executescript(_SCHEMA)
        except sqlite3.Error as e:
            raise ValueError(f"cannot open the usage database {path!r}: {e}") from None

    def write(self, records: list[UsageRecord]) -> None:
        if not records:
            return
        rows = [
            (r.time, r.key_id, r.user, r.model, r.prompt_tokens, r.cached_prompt_tokens,
             r.completion_tokens, r.cost_usd)
            for r in records
        ]  # fmt: skip
        with self._lock, self._conn:
            self._conn.executemany("INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?, ?, ?)", rows)

    def sums(self, query: UsageQuery) -> list[tuple[str | None, UsageCounts]]:
        """(group value, sums) per group, in group order; one (None, sums) without group_by."""
        where, args = [], []
        for column, value in (("key_id", query.key_id), ("user", query.user)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        if query.since is not None:
            where.append("ts >= ?")
            args.append(query.since)
        if query.until is not None:
            where.append("ts < ?")
            args.append(query.until)
        group = _COLUMNS[query.group_by] if query.group_by else "NULL"
        sql = (
            f"SELECT {group}, COUNT(*), COALESCE(SUM(prompt_tokens), 0), "
            "COALESCE(SUM(cached_prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0), "
            "COALESCE(SUM(cost_usd), 0.0) FROM usage"
            + (f" WHERE {' AND '.join(where)}" if where else "")
            + (" GROUP BY 1 ORDER BY 1" if query.group_by else "")
        )
        with self._lock:
            rows = self._conn.execute(sql, args).fetchall()
        return [
            (value, UsageCounts(requests=n, prompt_tokens=p, cached_prompt_tokens=c,
                                completion_tokens=g, total_tokens=p + g, cost_usd=cost))
            for value, n, p, c, g, cost in rows
        ]  # fmt: skip

    def close(self) -> None:
        with self._lock:
            self._conn.close()


class UsageMeter:
    """Meters requests (on the event loop), flushes them to the store (a thread), answers
    reports, and counts per key id in /metrics."""

    def __init__(
        self,
        store: UsageStore,
        prices: TokenPrices,
        registry: CollectorRegistry,
        flush_interval: float = 1.0,
    ) -> None:
        self.store = store
        self.prices = prices
        self.flush_interval = flush_interval
        self._pending: list[UsageRecord] = []
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tokens = Counter(
            "tokenmill:usage_tokens",
            "Metered tokens per API key id (kind: prompt, cached_prompt, completion).",
            ("key_id", "kind"),
            registry=registry,
        )
        self._requests = Counter(
            "tokenmill:usage_requests", "Metered requests per API key id.", ("key_id",),
            registry=registry,
        )  # fmt: skip
        self._cost = Counter(
            "tokenmill:usage_cost_usd",
            "Metered cost in USD per API key id, at the server's prices.",
            ("key_id",),
            registry=registry,
        )

    def record(
        self,
        key_id: str,
        user: str | None,
        model: str,
        prompt_tokens: int,
        cached_prompt_tokens: int,
        completion_tokens: int,
    ) -> UsageRecord:
        """Meter one request (cheap: the write happens in the flusher)."""
        cost = self.prices.cost(prompt_tokens, completion_tokens, cached_prompt_tokens)
        record = UsageRecord(
            time.time(), key_id, user, model, prompt_tokens, cached_prompt_tokens,
            completion_tokens, cost,
        )  # fmt: skip
        with self._pending_lock:
            self._pending.append(record)
        self._requests.labels(key_id).inc()
        self._tokens.labels(key_id, "prompt").inc(prompt_tokens)
        self._tokens.labels(key_id, "cached_prompt").inc(cached_prompt_tokens)
        self._tokens.labels(key_id, "completion").inc(completion_tokens)
        self._cost.labels(key_id).inc(cost)
        return record

    def start(self) -> None:
        """Start the background flusher."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="tokenmill-usage-flusher", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval):
            try:
                self.flush()
            except sqlite3.Error:  # kept in memory; the next flush tries again
                logger.exception("writing usage to %s failed", self.store.path)

    def flush(self) -> int:
        """Write the pending records; returns how many. A failed write keeps them pending."""
        with self._pending_lock:
            batch, self._pending = self._pending, []
        try:
            self.store.write(batch)
        except BaseException:
            with self._pending_lock:
                self._pending[:0] = batch
            raise
        return len(batch)

    def close(self) -> None:
        """Stop the flusher, write what is pending, close the store."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        num = self.flush()
        self.store.close()
        if num:
            logger.info("usage: wrote the last %d records to %s", num, self.store.path)

    def report(self, query: UsageQuery) -> UsageReport:
        """Sums per group and in total for ``query`` (flushes first). Runs in a thread."""
        self.flush()
        (_, total), *_ = self.store.sums(UsageQuery(query.key_id, query.user, query.since,
                                                     query.until))  # fmt: skip
        buckets = []
        if query.group_by is not None:
            field = "key_id" if query.group_by == "key" else query.group_by
            for value, counts in self.store.sums(query):
                buckets.append(UsageBucket(**{field: value}, **counts.model_dump()))
        else:
            buckets.append(UsageBucket(**total.model_dump()))
        return UsageReport(
            key_id=query.key_id,
            user=query.user,
            since=query.since,
            until=query.until,
            group_by=query.group_by,
            data=buckets,
            total=total,
        )


def parse_usage_query(items: Iterable[tuple[str, str]], caller: Caller) -> UsageQuery:
    """GET /v1/usage's query string (its name, value pairs), checked: 400 for a bad value, an
    unknown or repeated parameter, 403 when a user key asks for another key's usage (a user
    key sees only its own)."""
    params: dict[str, str] = {}
    for name, value in items:
        if name in params:
            raise bad_request(f"query parameter '{name}' is given twice", param=name)
        params[name] = value
    unknown = sorted(set(params) - set(QUERY_PARAMS))
    if unknown:
        raise bad_request(
            f"unknown query parameter '{unknown[0]}'; known: {', '.join(QUERY_PARAMS)}",
            param=unknown[0],
            code="unknown_field",
        )
    key = params.get("key")
    key_id = params.get("key_id")
    if key is not None and key_id is not None:
        raise bad_request("give 'key' or 'key_id', not both", param="key_id")
    if key is not None:
        if not key:
            raise bad_request("'key' must not be empty", param="key")
        key_id = key_id_of(key)
    elif key_id is not None and not _KEY_ID.match(key_id):
        raise bad_request(
            f"'key_id' must be 8 lowercase hex digits (as /v1/usage shows) or "
            f"'{NO_KEY_ID}'; got {key_id!r}",
            param="key_id",
        )
    if not caller.is_admin:
        if key_id is not None and key_id != caller.key_id:
            raise APIError(
                403,
                "this key may read only its own usage; the admin key reads any key's",
                param="key" if key is not None else "key_id",
                code="permission_denied",
            )
        key_id = caller.key_id
    group_by = params.get("group_by")
    if group_by is not None and group_by not in GROUP_BY:
        raise bad_request(
            f"group_by must be one of {', '.join(GROUP_BY)}; got {group_by!r}", param="group_by"
        )
    since = _parse_time(params.get("since"), "since")
    until = _parse_time(params.get("until"), "until")
    if since is not None and until is not None and until < since:
        raise bad_request("'until' must not be before 'since'", param="until")
    return UsageQuery(key_id, params.get("user"), since, until, group_by)


def _parse_time(value: str | None, name: str) -> float | None:
    """Unix seconds, or ISO 8601 (a date is its midnight; no zone means UTC)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if seconds != seconds or seconds in (float("inf"), float("-inf")):
            raise bad_request(f"'{name}' must be a finite time; got {value!r}", param=name)
        return seconds
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise bad_request(
            f"'{name}' must be unix seconds or an ISO 8601 date or time "
            f"(2026-01-31, 2026-01-31T12:00:00Z); got {value!r}",
            param=name,
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return when.timestamp()
