"""Reporting: atomic files and strict JSON, paths, figures, where results go and what is recorded with them, notebook
parameters. Takes tables and values, never models."""
