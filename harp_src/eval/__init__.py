"""Measuring quality: perplexity, fidelity to a reference model, lm-eval tasks with the fast exact scorer, long-context
items, over-smoothing metrics per layer, and bootstrap intervals."""
