"""Paired tables of a comparison (issue 27): every point's value with its interval beside its cost, each point minus
HARP at its level, the verdict (is HARP on the frontier?) and the causal-mean bypass against the identity.

They read a study's dict: runs (a row per point with its cost and speed), fidelity (per window), items (task items),
and mean_speed (harp-mean's timing round-robin with identity HARP).
"""

from __future__ import annotations

import pandas as pd

from ..eval.stats import mean_ci, paired_table
from .points import DENSE, FIDELITY, HARP, HARP_MEAN, LAMBADA, label

FRONTIER_COLUMNS = ["model", "method", "scope", "level", "n_layers", "budget_params", "params_removed", "metric",
                    "value", "ci_low", "ci_high", "n", "speedup_2k", "speedup_8k", "kv_bytes_per_token"]


def labelled(df: pd.DataFrame) -> pd.DataFrame:
    """`df` with each method named by `label`."""
    return df.assign(method=[label(m, s) for m, s in zip(df.method, df.scope, strict=True)])


def frontier_table(study: dict, seed: int = 0) -> pd.DataFrame:
    """figures/06_frontier.csv: per model, point and metric the value with its 95 % interval and n, beside the point's
    cost. Metrics: KL, Δ NLL and top-1 agreement against dense (mean over enwiki-test windows); each task's accuracy
    (interval over items) and its paired difference from dense on the same items ("<task> − dense")."""
    runs, fid, items = study["runs"], study["fidelity"], study["items"]
    keys = ["model", "method", "scope", "level"]
    rows = []
    for key, part in fid.groupby(keys, sort=False):
        for metric in FIDELITY:
            value, low, high = mean_ci(part[metric].to_numpy(), seed)
            rows.append(dict(zip(keys, key, strict=True), metric=metric, value=value, ci_low=low, ci_high=high,
                             n=len(part)))
    items = items.fillna({"scope": ""}) if len(items) else pd.DataFrame(columns=[*keys, "task", "correct", "doc_id"])
    for key, part in items.groupby([*keys, "task"], sort=False):
        value, low, high = mean_ci(part.correct.to_numpy(), seed)
        rows.append(dict(zip(keys, key[:4], strict=True), metric=key[4], value=value, ci_low=low, ci_high=high,
                         n=len(part)))
    point = items.method + "|" + items.scope + "|" + items.level  # one name per point, to pair with dense
    diffs = paired_table(items.assign(method=point.where(items.method != DENSE, DENSE)), DENSE, ["model", "task"],
                         seed=seed) if len(items) else pd.DataFrame()
    for r in diffs.itertuples():
        method, scope, level = r.method.split("|")
        rows.append(dict(model=r.model, method=method, scope=scope, level=level, metric=f"{r.task} − dense",
                         value=r.diff, ci_low=r.ci_low, ci_high=r.ci_high, n=r.n))
    cost = runs[[*keys, "n_layers", "budget_params", "params_removed", "speedup_2k", "speedup_8k",
                 "kv_bytes_per_token"]].fillna({"scope": "", "level": ""})
    table = pd.DataFrame(rows).merge(cost, on=keys, how="left")
    return table[FRONTIER_COLUMNS]


def versus_harp(study: dict, seed: int = 0) -> pd.DataFrame:
    """Each point minus HARP at the same level, paired on the same windows (KL, Δ NLL, top-1) and items (tasks):
    model, level, metric, method, diff, ci_low, ci_high, n, decided. For KL and Δ NLL a negative difference means
    closer to dense than HARP; for top-1 and tasks, a positive one."""
    fid = labelled(study["fidelity"])
    long = pd.concat([fid.assign(metric=m, value=fid[m]) for m in FIDELITY], ignore_index=True)
    parts = [paired_table(long, HARP, ["model", "level", "metric"], unit="window", value="value", seed=seed)]
    items = study["items"]
    if len(items):
        items = labelled(items[items.method != DENSE].fillna({"scope": ""})).rename(columns={"task": "metric"})
        parts.append(paired_table(items, HARP, ["model", "level", "metric"], seed=seed))
    return pd.concat(parts, ignore_index=True)


def verdict(study: dict, vs: pd.DataFrame) -> pd.DataFrame:
    """Per model and level: is HARP on the frontier? A point is better than HARP on a metric when its interval
    excludes 0 in its favour (lower KL; higher LAMBADA accuracy): better_on_kl/lambada, which no timing changes. It
    dominates HARP there when it is also at least as fast in the long prefill (measured medians, no interval).
    Better-but-slower points are listed apart."""
    runs = labelled(study["runs"][study["runs"].method != DENSE])
    rows = []
    for (model, level), part in runs.groupby(["model", "level"], sort=False):
        speed = part.set_index("method").speedup_8k
        row = dict(model=model, level=level, harp_speedup_8k=float(speed[HARP]))
        better = {}
        for metric, sign in (("kl", -1), (LAMBADA, 1)):
            d = vs[(vs.model == model) & (vs.level == level) & (vs.metric == metric) & vs.decided]
            better[metric] = sorted(d[d["diff"] * sign > 0].method)
            short = "kl" if metric == "kl" else "lambada"
            row[f"better_on_{short}"] = ", ".join(better[metric]) or "none"
            row[f"dominates_on_{short}"] = ", ".join(
                m for m in better[metric] if speed[m] >= speed[HARP]) or "none"
        slower = sorted({m for ms in better.values() for m in ms if speed[m] < speed[HARP]})
        row["better_but_slower"] = ", ".join(slower) or "none"
        row["harp_on_frontier"] = row["dominates_on_kl"] == "none" and row["dominates_on_lambada"] == "none"
        rows.append(row)
    return pd.DataFrame(rows)


def mean_versus_identity(study: dict, vs: pd.DataFrame) -> pd.DataFrame:
    """harp-mean against identity HARP per model, level and metric (KL, LAMBADA, ARC-Easy where measured): the paired
    difference mean − identity with its interval, n and `decided`, beside both bypasses' prefill speed-up at the long
    length and decode speed-up there, timed side by side in one round-robin with dense."""
    if study["mean_speed"].empty:
        return pd.DataFrame()
    d = vs[(vs.method == HARP_MEAN) & vs.metric.isin(["kl", LAMBADA, "arc_easy"])]
    speed = study["mean_speed"].pivot_table(index=["model", "level"], columns="method",
                                            values=["speedup_8k", "decode_speedup_8k"], sort=False)
    speed.columns = [f"{method} {stat}" for stat, method in speed.columns]
    keep = ["model", "level", "metric", "diff", "ci_low", "ci_high", "n", "decided"]
    return d[keep].merge(speed.reset_index(), on=["model", "level"], how="left")


def point_tables(study: dict, seed: int = 0) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(frontier_table, versus_harp) of a study: every point's values with intervals, each point minus HARP."""
    return frontier_table(study, seed), versus_harp(study, seed)
