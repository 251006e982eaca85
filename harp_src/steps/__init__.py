"""A long study as a graph of stored steps, run inline or on Ray (see graph.py, executors.py, plan.py)."""

from .executors import EXECUTORS, Outcome, run_steps
from .graph import Graph, Step

__all__ = ["EXECUTORS", "Graph", "Outcome", "Step", "run_steps"]
