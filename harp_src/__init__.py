"""HARP — High-layer Attention Rescaled Pruning (Liu & Liu, arXiv 2507.01900): reference implementation."""

from .baselines import PruneRecord, prune
from .checkpoints import load_model, save_checkpoint
from .data import ppl_windows
from .evaluate import perplexity
from .harp import HarpPlan, apply_harp, param_report
from .search import search_alphas

__all__ = ["load_model", "ppl_windows", "perplexity", "apply_harp", "HarpPlan", "search_alphas", "param_report",
           "save_checkpoint", "prune", "PruneRecord"]
