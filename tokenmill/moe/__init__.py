"""Sparse mixture-of-experts MLPs: the router and the stacked experts (experts.py), and the
loop-over-experts reference they are tested against (reference.py)."""

from tokenmill.moe.experts import FusedMoE, Router

__all__ = ["FusedMoE", "Router"]
