"""HARP — High-layer Attention Rescaled Pruning (Liu & Liu, arXiv 2507.01900): reference implementation.

The public API; the rest lives in subpackages by capability (see the README's code map).
"""

from .checkpoints import load_model, save_checkpoint
from .data.corpora import ppl_windows
from .eval.perplexity import perplexity
from .method.accounting import param_report
from .method.harp import HarpPlan, apply_harp
from .method.search import search_alphas
from .pruning.prune import prune
from .pruning.record import PruneRecord

__all__ = ["load_model", "ppl_windows", "perplexity", "apply_harp", "HarpPlan", "search_alphas", "param_report",
           "save_checkpoint", "prune", "PruneRecord"]
