"""Where the text and items come from, offline: enwiki and Lee news split into train and test, windows and calibration
samples, synthetic long-context items, and lm-eval task definitions with their local data."""
