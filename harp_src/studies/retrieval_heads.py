"""Notebook 11: does keeping a few retrieval heads give HARP its reading back, and at what KV and speed cost?

Per model, at quarter depth: every query head gets two training-free retrieval scores on enwiki-train text (the
induction mass on repeated random tokens, and Wu et al.'s copy-paste hit rate on passkeys), and the points are

- HARP and `harp-mean` (06's), and 06's best baselines at HARP's real parameter drop (BASELINES);
- `harp-keep`: HARP keeping the top-k query heads of the pruned layers by induction score, for each k that is a
  fraction of those layers' heads (KEEP_FRACTIONS), α searched with the heads kept (it scales only the others);
- `harp-random`: the same k heads drawn at random from the pruned layers (the control), α searched the same way;
- `attn-drop-top` at the same KV bytes as each `harp-keep`: the top m attention sub-layers dropped, with m the number
  of layers' worth of KV groups `harp-keep` no longer caches (whole layers only: the nearest count);
- with RELEASE_CONFIG, the paper's released configuration `harp+flap` (HARP, then FLAP on MLP channels calibrated on
  the HARP model, FLAP's budget what the release scripts give it: all attention weights of the top N layers less
  HARP's Q + K, in the paper's convention), beside the attention of the same N layers dropped and FLAP [mlp] alone at
  `harp+flap`'s real parameter drop. Ours removes more than the paper's convention counts: its bypass holds V and O
  folded into one projection per KV group, so the attention drop of the same layers removes fewer parameters.

Each point: KL to dense on enwiki-test windows, its lm-eval tasks (LAMBADA, ARC-Easy) and passkey retrieval at
LC_LENGTHS (greedy exact match) on the same items as dense, KV bytes per token at the long timing length, and, for
HARP, `harp-mean`, `harp-keep`, the baselines and the release configuration, prefill and decode speed measured
interleaved with dense. Beside the two retrieval scores, 07's Taylor and LRP head scores on the calibration windows,
to say how far "reads from the context" and "matters for the loss" pick the same heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import ClassVar

import numpy as np
import pandas as pd
from scipy.stats import spearmanr

from ..compare.points import (
    DENSE,
    HARP,
    HARP_FLAP,
    HARP_KEEP,
    HARP_MEAN,
    HARP_RANDOM,
    LIKE,
    RELEASE,
    ModelSteps,
    label,
    point_step,
    points_of,
    rebuild,
    speed_settings,
    variants,
)
from ..data.corpora import bos_id
from ..data.longcontext import passkey_items
from ..eval.longcontext import long_context_eval
from ..eval.stats import mean_ci, paired_table
from ..heads.gates import taylor_head_scores
from ..heads.lrp import lrp_head_scores
from ..heads.retrieval import copy_paste_scores, repeated_sequences, retrieval_scores
from ..measure.kv import kv_bytes_at
from ..method.layers import quarter_depth
from ..method.search import search_alphas
from ..model.adapter import get_adapter
from ..model.loading import model_info
from ..report.params import StudyParams
from ..steps import context
from ..steps.executors import run_steps
from ..steps.graph import Graph

ATTN_DROP = "attn-drop-top"  # the attention drop at harp-keep's KV bytes
PASSKEY = "passkey"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)  # where the key sits in a passkey prompt, spread evenly over the items


@dataclass(frozen=True)
class RetrievalParams(StudyParams):
    """Notebook 11's parameters: models, the pruned depth, the kept-head fractions, the baselines, tasks, passkey
    items, the retrieval scores' sizes, windows and timing; MODEL_SIZES gives one model smaller (or larger) sizes."""

    NOTEBOOK: ClassVar[str] = "11_retrieval_heads"
    SIZE_NAMES: ClassVar[tuple] = ("LIMIT", "LC_ITEMS", "COPY_ITEMS", "SCORE_SEQS", "N_CALIB", "N_EVAL")
    TYPES: ClassVar[dict] = {"LIMIT": int | dict, "BASELINES": list[str]}
    models: list[str]
    n_layers: int
    keep_fractions: list[float]
    baselines: list[str]
    release_config: bool
    tasks: list[str]
    limit: int | dict
    lc_lengths: list[int]
    lc_items: int
    score_seqs: int
    score_len: int
    copy_items: int
    copy_len: int
    n_calib: int
    calib_len: int
    n_eval: int
    eval_len: int
    speed_lens: list[int]
    speed_repeats: int
    decode_steps: int
    seed: int
    dtype: str
    device: str
    reuse_parts: bool
    model_sizes: dict

    def check(self) -> None:
        """Refuse bad values before any model loads (each model's own sizes too)."""
        fractions = list(self.keep_fractions)
        if not fractions or fractions != sorted(set(fractions)) or not all(0 < f <= 1 for f in fractions):
            raise ValueError(f"KEEP_FRACTIONS must be ascending distinct shares in (0, 1], got {fractions}")
        variants(self.baselines)
        if len(self.speed_lens) != 2 or self.speed_lens[0] >= self.speed_lens[1]:
            raise ValueError(f"SPEED_LENS must be two increasing prompt lengths, got {self.speed_lens}")
        if self.lc_items < 1 or self.copy_items < 1 or self.score_seqs < 1:
            raise ValueError("LC_ITEMS, COPY_ITEMS and SCORE_SEQS must be at least 1")
        for model, sizes in self.model_sizes.items():
            if model not in self.models:
                raise ValueError(f"MODEL_SIZES names {model!r}, which MODELS {self.models} does not list")
            other = sorted(set(sizes) - set(self.SIZE_NAMES)) if isinstance(sizes, dict) else [repr(sizes)]
            if other:
                raise ValueError(f"MODEL_SIZES[{model!r}] may set only {list(self.SIZE_NAMES)}, got {other}")
            self.for_model(model).check()

    def for_model(self, name: str) -> RetrievalParams:
        """The parameters model `name`'s steps are declared with: its MODEL_SIZES entry over the shared sizes, type
        checked (a model without an entry keeps the shared sizes, and so its keys and stored steps)."""
        sizes = self.model_sizes.get(name, {})
        if not sizes:
            return self
        values = {f.name.upper(): getattr(self, f.name) for f in fields(self)}
        return type(self).from_values(values | sizes | {"MODEL_SIZES": {}})


# ---------------------------------------------------------------------------------------------- choosing heads
def pruned_layers(num_layers: int, n: int) -> list[int]:
    return list(range(num_layers - n, num_layers))


def share(fraction: float) -> str:
    """A kept-head fraction as the points name it: 0.05 -> "5%"."""
    return f"{100 * fraction:g}%"


def k_of(fraction: float, n_layers: int, n_heads: int) -> int:
    """Kept heads for a fraction of the pruned layers' query heads (at least one)."""
    return max(1, round(fraction * n_layers * n_heads))


def choose_heads(scores: pd.DataFrame, layers: list[int], k: int, how: str, seed: int = 0) -> dict[int, list[int]]:
    """{layer: [query head, ...]}: the k heads of `layers` with the highest induction score (`how="top"`; ties to
    the lower layer and head) or k drawn uniformly at random (`how="random"`, seeded)."""
    heads = scores[scores.layer.isin(layers)].sort_values(["layer", "head"])
    if how == "top":
        chosen = heads.sort_values("retrieval", ascending=False, kind="stable").head(k)
    elif how == "random":
        chosen = heads.iloc[np.random.default_rng(seed).choice(len(heads), size=k, replace=False)]
    else:
        raise ValueError(f"unknown head choice {how!r}: top or random")
    out: dict[int, list[int]] = {}
    for layer, head in zip(chosen["layer"], chosen["head"], strict=True):
        out.setdefault(int(layer), []).append(int(head))
    return {i: sorted(hs) for i, hs in sorted(out.items())}


def kv_layers_freed(keep: dict[int, list[int]], n_layers: int, n_rep: int, n_kv: int) -> int:
    """Layers' worth of KV groups a kept-heads plan of `n_layers` layers no longer caches, to the nearest whole layer
    (the attention drop that holds the same KV bytes drops this many)."""
    cached = sum(len({h // n_rep for h in hs}) for hs in keep.values())
    return max(1, round(n_layers - cached / n_kv))


def passkey_prompts(tok, lengths: list[int], n: int, seed: int, split: str = "test") -> list[dict]:
    """`n` passkey prompts per length, their keys spread over DEPTHS: ceil(n / 5) per depth drawn, then `n` of them at
    evenly spaced places in that order (every one where `n` is a multiple of 5, so those draws are as they were)."""
    per_cell = math.ceil(n / len(DEPTHS))
    items, drawn = passkey_items(tok, tuple(lengths), DEPTHS, per_cell, seed, split=split), per_cell * len(DEPTHS)
    chosen = np.linspace(0, drawn - 1, n).round().astype(int)
    return [items[j * drawn + int(i)] for j in range(len(lengths)) for i in chosen]


def exact_count(n: int) -> dict:
    """A key entry for prompt counts that are no multiple of 5: earlier code drew ceil(n / 5) per depth and kept them
    all, so such a step stored by it must not be reused; other counts keep their keys (and stored full runs)."""
    return {} if n % len(DEPTHS) == 0 else {"prompts": "exactly n"}


# ---------------------------------------------------------------------------------------------- steps
def scores_step(key: dict, inputs: dict) -> dict:
    """Both retrieval scores of every query head on enwiki-train text, and the model's provenance."""
    setup = key["setup"]
    dense, tok = context.dense(setup)
    seqs = repeated_sequences(context.windows(setup, "train"), key["score_seqs"], key["score_len"], setup["seed"],
                              bos_id(tok))
    scores = retrieval_scores(dense, seqs, int(bos_id(tok) is not None), progress=False)
    items = passkey_prompts(tok, [key["copy_len"]], key["copy_items"], setup["seed"], split="train")
    copy = copy_paste_scores(dense, tok, items, progress=False)
    return {"scores": scores.merge(copy, on=["layer", "head", "kv_group"]), "info": model_info(dense)}


def importance_step(key: dict, inputs: dict) -> pd.DataFrame:
    """07's Taylor (per-layer L2-normalised |∂L/∂gate|) and LRP head scores of every query head on the calibration
    windows (enwiki train): layer, head, taylor, lrp."""
    setup = key["setup"]
    dense, calib = context.dense(setup)[0], context.windows(setup, "train")
    taylor = taylor_head_scores(dense, calib, progress=False)
    lrp = lrp_head_scores(dense, calib, progress=False)
    return pd.DataFrame([dict(layer=i, head=h, taylor=float(taylor[i, h]), lrp=float(lrp[i, h]))
                         for i in range(taylor.shape[0]) for h in range(taylor.shape[1])])


def keep_search_step(key: dict, inputs: dict) -> dict:
    """{"alphas", "keep_heads", "k"}: k heads chosen (k from key's fraction of the pruned layers' query heads; top by
    induction score, or random), then α searched with them kept."""
    setup = key["setup"]
    dense, layers = context.dense(setup)[0], key["layers"]
    k = k_of(key["fraction"], len(layers), get_adapter(dense).n_heads)
    keep = choose_heads(inputs["scores"]["scores"], layers, k, key["how"], setup["seed"])
    alphas = search_alphas(dense, context.windows(setup, "train"), layers, keep_heads=keep)
    return {"alphas": alphas, "keep_heads": keep, "k": k}


def kv_drop_step(key: dict, inputs: dict) -> tuple:
    """The attention drop holding harp-keep's KV bytes (`kv_layers_freed` top layers dropped), built and measured as
    any point (`compare.points.point_step`)."""
    ad = get_adapter(context.dense(key["setup"])[0])
    keep = inputs["keep"]["keep_heads"]
    m = kv_layers_freed(keep, key["recipe"]["n_layers"], ad.n_rep, ad.n_kv_heads)
    recipe = key["recipe"] | {"budget": {"attention_layers": m}}
    return point_step(key | {"recipe": recipe}, {"plan": inputs["plan"]})


def reading_step(key: dict, inputs: dict) -> dict:
    """A point's (or dense's) passkey answers on enwiki-test prompts and its KV bytes per token at the long length."""
    setup = key["setup"]
    dense, tok = context.dense(setup)
    model = dense if key["which"] == DENSE else rebuild(dense, inputs["p0"][0])
    items = passkey_prompts(tok, key["lc_lengths"], key["lc_items"], setup["seed"])
    answers = long_context_eval(model, tok, items, progress=False)
    return {"answers": answers, "kv_bytes_per_token": kv_bytes_at(model, key["long"]) / key["long"]}


# ---------------------------------------------------------------------------------------------- the graph
def _declare_model(graph: Graph, p: RetrievalParams, name: str) -> dict:
    """One model's steps: scores, searches, a point per method (and k), their reading, dense's tasks, the timing."""
    p = p.for_model(name)
    ms = ModelSteps.open(graph, p, name)
    n = p.n_layers or quarter_depth(ms.num_layers)
    layers = pruned_layers(ms.num_layers, n)
    ids = {"name": name, "n": n, "points": [], "search": ms.search(n)}
    copy = {"copy_items": p.copy_items, "copy_len": p.copy_len, **exact_count(p.copy_items)}
    ids["scores"] = ms.add(scores_step, {"score_seqs": p.score_seqs, "score_len": p.score_len, **copy}, label="scores")
    ids["importance"] = ms.add(importance_step, {}, label="Taylor and LRP scores",
                               size=2 * p.n_calib * p.calib_len / 512)
    level, tasks, limit = f"N={n}", list(p.tasks), p.limit
    recipe = dict(method=HARP, scope="attention", level=level, n_layers=n, budget="N")
    ids["points"].append(ms.point(recipe, ids["search"], None, tasks, limit))
    recipe = dict(method=HARP_MEAN, scope="attention", level=level, n_layers=n, budget="N")
    ids["points"].append(ms.point(recipe, ids["search"], ms.search(n, "mean"), tasks, limit))
    for method, scope in variants(p.baselines):
        recipe = dict(method=method, scope=scope, level=level, n_layers=n, budget="N")
        ids["points"].append(ms.point(recipe, ids["search"], None, tasks, limit))
    ids["timed"], ids["keep"] = list(ids["points"]), {}
    for fraction in p.keep_fractions:
        for method, how in ((HARP_KEEP, "top"), (HARP_RANDOM, "random")):
            search = ms.add(keep_search_step, {"layers": layers, "fraction": fraction, "how": how},
                            {"scores": ids["scores"]}, f"search {method} {share(fraction)}",
                            size=n * p.n_calib * p.calib_len / 256)
            ids["keep"][(method, fraction)] = search
            recipe = dict(method=method, scope=share(fraction), level=level, n_layers=n, budget="N")
            ids["points"].append(ms.point(recipe, ids["search"], search, tasks, limit))
        ids["timed"].append(ids["points"][-2])  # harp-keep; the random control has its cost at the same k
        recipe = dict(method=ATTN_DROP, scope="attention", level=f"KV of {HARP_KEEP} {share(fraction)}",
                      n_layers=n)
        ids["points"].append(ms.add(kv_drop_step, {"recipe": recipe, "tasks": tasks, "limit": limit},
                                    {"plan": ids["search"], "keep": ids["keep"][(HARP_KEEP, fraction)]},
                                    f"point attn-drop, KV of {share(fraction)}"))
    if p.release_config:  # the release scripts' model, the same layers' attention dropped, FLAP alone at its drop
        recipe = dict(method=HARP_FLAP, scope="mlp", level=RELEASE, n_layers=n, budget=RELEASE)
        release = ms.point(recipe, ids["search"], None, tasks, limit)
        recipe = dict(method=ATTN_DROP, scope="attention", level=RELEASE, n_layers=n, budget={"attention_layers": n})
        same_layers = ms.point(recipe, ids["search"], None, tasks, limit)
        recipe = dict(method="flap", scope="mlp", level=RELEASE, n_layers=n, budget=LIKE)
        alone = ms.add(point_step, {"recipe": recipe, "tasks": tasks, "limit": limit},
                       {"plan": ids["search"], "like": release}, f"point flap [mlp] at {HARP_FLAP}'s drop")
        ids["points"] += [release, same_layers, alone]
        ids["timed"] += [release, same_layers, alone]
    ids["dense"] = ms.scored(DENSE, tasks, limit)
    lc = {"lc_lengths": list(p.lc_lengths), "lc_items": p.lc_items, "long": p.speed_lens[1], **exact_count(p.lc_items)}
    size = p.lc_items * sum(p.lc_lengths) / 1024
    ids["reading"] = {DENSE: ms.add(reading_step, {"which": DENSE, **lc}, label="passkey dense", size=size)}
    for i in ids["points"]:
        ids["reading"][i] = ms.add(reading_step, {"which": "point", **lc}, {"p0": i}, "passkey", size=size)
    ids["timing"] = ms.timing(ids["timed"], speed_settings(p), pairs_first=False)
    return ids


def retrieval_graph(p: RetrievalParams) -> tuple[Graph, list[dict]]:
    """The study's steps for every model, and each model's step ids by role."""
    graph = Graph()
    return graph, [_declare_model(graph, p, name) for name in p.models]


# ---------------------------------------------------------------------------------------------- tables
KEEP_LINE = f"attn-drop-top at {HARP_KEEP}'s KV"  # the attention-drop points, one per kept fraction
BESIDE_RELEASE = {ATTN_DROP: f"{ATTN_DROP} of {HARP_FLAP}'s layers",  # the points harp+flap is paired with
                  "flap": f"flap [mlp] at {HARP_FLAP}'s drop"}


def point_names(row: dict) -> tuple[str, str]:
    """(line, point): the method a point's line in the figure belongs to (kept heads over k: one line each), and the
    point's own name."""
    method = row["method"]
    if method in (HARP_KEEP, HARP_RANDOM):
        return method, f"{method} {row['scope']}"
    if method == ATTN_DROP and row["level"].startswith("KV of"):
        return KEEP_LINE, f"{ATTN_DROP}, {row['level']}"
    if row["level"] == RELEASE and method != HARP_FLAP:
        return BESIDE_RELEASE[method], BESIDE_RELEASE[method]
    return label(method, row["scope"]), label(method, row["scope"])


def _point_rows(ids: dict, res: dict) -> tuple[list[dict], list[pd.DataFrame], list[pd.DataFrame]]:
    """Per point (dense first): its cost row, its KL per window, its items (tasks and passkey: task, unit, correct)."""
    name, speed = ids["name"], res[ids["timing"]]
    k_at = {share(f): res[i]["k"] for (m, f), i in ids["keep"].items() if m == HARP_KEEP}
    k_random = {share(f): res[i]["k"] for (m, f), i in ids["keep"].items() if m == HARP_RANDOM}
    dense_items = pd.DataFrame(res[ids["dense"]]["items"])
    rows = [dict(model=name, line=DENSE, point=DENSE, k=0, params_removed=0,
                 kv_bytes_per_token=res[ids["reading"][DENSE]]["kv_bytes_per_token"], speedup_8k=1.0,
                 decode_speedup_8k=1.0, alphas=None, keep_heads=None)]
    windows = []
    items = [_items(name, DENSE, dense_items, res[ids["reading"][DENSE]]["answers"])]
    for i, (row, fid, found) in zip(ids["points"], zip(*points_of(res, ids["points"]), strict=True), strict=True):
        line, point = point_names(row)
        fraction = row["level"].rsplit(" ", 1)[-1] if line == KEEP_LINE else row["scope"]  # "5%": its harp-keep's
        k = (k_random if row["method"] == HARP_RANDOM else k_at).get(fraction, 0)
        timed = speed.get(row["shape"], {})
        rows.append(dict(model=name, line=line, point=point, k=k, params_removed=row["params_removed"],
                         kv_bytes_per_token=res[ids["reading"][i]]["kv_bytes_per_token"],
                         speedup_8k=timed.get("speedup_8k", np.nan),
                         decode_speedup_8k=timed.get("decode_speedup_8k", np.nan), alphas=row["alphas"],
                         keep_heads=row["keep_heads"]))
        windows.append(fid[["window", "kl"]].assign(model=name, point=point))
        items.append(_items(name, point, pd.DataFrame(found), res[ids["reading"][i]]["answers"]))
    return rows, windows, items


def _items(name: str, point: str, tasks: pd.DataFrame, answers: pd.DataFrame) -> pd.DataFrame:
    """A point's scored items: its task items and its passkey answers, as model, point, metric, unit, correct."""
    parts = [] if tasks.empty else [tasks[["task", "doc_id", "correct"]].rename(columns={"task": "metric",
                                                                                          "doc_id": "unit"})]
    if len(answers):
        parts.append(pd.DataFrame({"metric": PASSKEY, "unit": answers["item"], "correct": answers["correct"]}))
    out = pd.concat(parts, ignore_index=True)
    return out.assign(model=name, point=point, correct=out.correct.astype(float))


def retrieval_study(p: RetrievalParams) -> dict:
    """Every model's graph (`retrieval_graph`), run inline where the runner has not run it already, read into tables.

    Returns:
        dict: points (a row per point: line, point, k, params_removed, kv_bytes_per_token, speed-ups, α's, kept
        heads), windows (KL per enwiki-test window), items (model, point, metric, unit, correct: tasks and passkey),
        scores (both retrieval scores and the Taylor and LRP scores per head), infos, seconds.
    """
    graph, models = retrieval_graph(p)
    out = run_steps(graph, reuse=p.reuse_parts)
    parts = [_point_rows(ids, out.results) for ids in models]
    scores = [out.results[ids["scores"]]["scores"].merge(out.results[ids["importance"]], on=["layer", "head"])
              .assign(model=ids["name"], pruned=lambda d, n=ids["n"]: d.layer >= d.layer.max() + 1 - n)
              for ids in models]
    seconds = [dict(model=ids["name"], seconds=sum(out.provenance[i].get("seconds", 0.0) for i in graph.steps
                                                   if graph.steps[i].key["setup"]["model"] == ids["name"]))
               for ids in models]
    return {"points": pd.DataFrame([r for rows, _, _ in parts for r in rows]),
            "windows": pd.concat([w for _, ws, _ in parts for w in ws], ignore_index=True),
            "items": pd.concat([i for _, _, its in parts for i in its], ignore_index=True),
            "scores": pd.concat(scores, ignore_index=True), "seconds": pd.DataFrame(seconds),
            "infos": [out.results[ids["scores"]]["info"] for ids in models]}


TABLE_COLUMNS = ["model", "method", "line", "k", "params_removed", "kv_bytes_per_token", "speedup_8k",
                 "decode_speedup_8k", "metric", "value", "ci_low", "ci_high", "n", "reference"]


def retrieval_table(study: dict, seed: int = 0) -> pd.DataFrame:
    """figures/11_retrieval.csv: per model, point and metric (KL to dense; each task's and passkey's accuracy) the
    value with its 95 % interval beside the point's cost; then the paired rows, `harp-keep` minus HARP and minus the
    random control at the same k, on the same windows and items (`reference` names what was subtracted)."""
    windows = study["windows"].rename(columns={"kl": "correct", "window": "unit"}).assign(metric="kl")
    scored = pd.concat([windows, study["items"]], ignore_index=True)
    rows = []
    for (model, point, metric), part in scored.groupby(["model", "point", "metric"], sort=False):
        value, low, high = mean_ci(part.correct.to_numpy(), seed)
        rows.append(dict(model=model, method=point, metric=metric, value=value, ci_low=low, ci_high=high,
                         n=len(part), reference=""))
    for (model, keep), ref in pairs_of(study["points"]):
        part = scored[(scored.model == model) & scored.point.isin([keep, ref])].rename(columns={"point": "method"})
        for r in paired_table(part, ref, ["metric"], unit="unit", seed=seed).itertuples():
            rows.append(dict(model=model, method=keep, metric=r.metric, value=r.diff, ci_low=r.ci_low,
                             ci_high=r.ci_high, n=r.n, reference=ref))
    cost = study["points"].rename(columns={"point": "method"})[["model", "method", *TABLE_COLUMNS[2:8]]]
    return pd.DataFrame(rows).merge(cost, on=["model", "method"], how="left")[TABLE_COLUMNS]


def pairs_of(points: pd.DataFrame) -> list[tuple[tuple[str, str], str]]:
    """((model, point), reference) of the paired rows: every `harp-keep` point minus HARP and minus the random control
    at the same k; `harp+flap` minus the attention drop of its layers and minus FLAP [mlp] at its drop (where
    measured)."""
    out = []
    for r in points[points.line == HARP_KEEP].itertuples():
        out.append(((r.model, r.point), HARP))
        out.append(((r.model, r.point), r.point.replace(HARP_KEEP, HARP_RANDOM)))
    for r in points[points.point == HARP_FLAP].itertuples():
        same = points[(points.model == r.model) & points.point.isin(BESIDE_RELEASE.values())]
        out += [((r.model, r.point), ref) for ref in same.point]
    return out


SCORE_NAMES = {"retrieval": "induction", "copy_paste": "copy-paste", "taylor": "Taylor", "lrp": "LRP"}
AGREEMENT = (("retrieval", "copy_paste"), ("retrieval", "taylor"), ("retrieval", "lrp"), ("copy_paste", "taylor"),
             ("copy_paste", "lrp"))  # each retrieval score against the other and against 07's two


def score_agreement(scores: pd.DataFrame) -> pd.DataFrame:
    """How the head scores agree, per model and pair (`AGREEMENT`: the two retrieval scores, and each against 07's
    Taylor and LRP): Spearman's ρ with its p-value over every head and over the pruned layers' heads, and how many of
    the top 10 heads by the first score are among the top 10 by the second."""
    rows = []
    for model, part in scores.groupby("model", sort=False):
        for where, heads in (("all layers", part), ("pruned layers", part[part.pruned])):
            for a, b in AGREEMENT:
                res = spearmanr(heads[a], heads[b])
                top = set(heads.nlargest(10, a).index) & set(heads.nlargest(10, b).index)
                rows.append(dict(model=model, heads=where, a=SCORE_NAMES[a], b=SCORE_NAMES[b], n=len(heads),
                                 spearman=float(res.statistic), p=float(res.pvalue), top10_shared=len(top)))
    return pd.DataFrame(rows)


def heads_long(scores: pd.DataFrame) -> pd.DataFrame:
    """The two scores in long form for the heat maps: model, metric, layer, head, score."""
    names = {"retrieval": "induction (repeated tokens)", "copy_paste": "copy-paste (passkeys, Wu et al.)"}
    return pd.concat([scores.assign(metric=label_, score=scores[col])[["model", "metric", "layer", "head", "score"]]
                      for col, label_ in names.items()], ignore_index=True)


def summarise_retrieval(table: pd.DataFrame, agreement: pd.DataFrame, study: dict) -> dict:
    """Headline numbers: every value and paired difference with its interval, the score agreement, the kept heads
    and the compute seconds per model."""
    out = {}
    for r in table.itertuples():
        name = f"{r.model}/{r.method}/{r.metric}" + (f" − {r.reference}" if r.reference else "")
        out[name] = float(r.value)
        out[f"{name}/ci"] = [float(r.ci_low), float(r.ci_high)]
    for r in study["points"].itertuples():
        out |= {f"{r.model}/{r.point}/k": int(r.k), f"{r.model}/{r.point}/params_removed": int(r.params_removed),
                f"{r.model}/{r.point}/kv_bytes_per_token": float(r.kv_bytes_per_token)}
        if r.keep_heads:
            out[f"{r.model}/{r.point}/keep_heads"] = {str(k): v for k, v in r.keep_heads.items()}
    for r in agreement.itertuples():
        out[f"{r.model}/{r.heads}/spearman/{r.a} vs {r.b}"] = float(r.spearman)
    for r in study["seconds"].itertuples():
        out[f"{r.model}/seconds"] = float(r.seconds)
    return out
