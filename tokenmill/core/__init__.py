"""Scheduling and KV-block bookkeeping. Pure Python: no torch, no models."""

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.sched_output import RunnerOutput, SchedulerOutput
from tokenmill.core.scheduler import Scheduler

__all__ = ["BlockPool", "KVCacheManager", "RunnerOutput", "Scheduler", "SchedulerOutput"]
