"""HARP — High-layer Attention Rescaled Pruning (Liu & Liu, arXiv 2507.01900): reference implementation."""

from .baselines import PruneRecord, prune  # importing it also lets load_model restore baseline records
from .data import ppl_windows
from .evaluate import perplexity
from .harp import HarpPlan, apply_harp, param_report
from .models import load_model
from .search import search_alphas

__all__ = ["load_model", "ppl_windows", "perplexity", "apply_harp", "HarpPlan", "search_alphas", "param_report",
           "prune", "PruneRecord"]
