"""Per-item gold-answer bits per byte for the `*_gold_bpb` tasks: how many bits the model spends per UTF-8 byte of
the reference answer, given the request's prompt. lm-eval's `bits_per_byte` aggregation pools log-likelihoods over
items (a ratio of sums); here each item gets its own value, so the task score is their mean and two models can be
compared item by item (paired intervals)."""

import math


def process_results(doc: dict, results: list) -> dict:
    """{"bpb": -log2 P(continuation | context) / bytes(continuation)} of one item (lower is better)."""
    loglikelihood, _ = results[0]
    return {"bpb": -loglikelihood / (math.log(2) * len(doc["continuation"].encode("utf-8")))}
