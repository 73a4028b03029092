"""Runs the model: turns a SchedulerOutput into flat tensors, a forward pass, and samples."""

from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.sampler import Sampler

__all__ = ["ModelRunner", "Sampler"]
