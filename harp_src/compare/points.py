"""Points (a HARP variant or a baseline pruned from one dense model, measured against it) as steps of a graph.

A point is a recipe (method, scope, level, n_layers and where its budget and α's come from). Each piece of work on a
model is a step (`harp_src.steps`): an α search, a point built and measured (fidelity on the evaluation windows and
its tasks), a scoring of more tasks on chosen points, the timing of every shape. A step's key names what it depends
on, its needs are the steps whose results it reads (the searched α's, the points), and its function loads what it
needs itself through `steps.context`: the model by name, the windows by their spec, the dense states on them.
`ModelSteps` declares one model's steps; a study declares its graph with it and reads the results into tables.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

from ..eval.fidelity import fidelity_windows
from ..eval.tasks import limits_for, run_tasks
from ..measure.timing import REFERENCE, kv_bytes_formula, shape_key, time_shapes, trim_heap
from ..method.accounting import param_report
from ..method.harp import HarpPlan, apply_harp
from ..method.layer_choice import layer_scores, lowest_layers
from ..method.search import search_alphas
from ..model.adapter import fingerprint
from ..model.loading import model_shape
from ..model.weights import held_bytes, n_params, sharing_copy
from ..pruning.budgets import budgets
from ..pruning.methods import METHODS, SCOPES, UNSTRUCTURED
from ..pruning.prune import pruned_copy, shared_copy
from ..pruning.release import METHOD as HARP_FLAP
from ..pruning.release import harp_flap, harp_flap_again
from ..steps import context
from ..steps.graph import Graph, Step

DENSE, HARP, HARP_BI, HARP_MEAN, PAPER = "dense", "harp", "harp-bi", "harp-mean", "paper"
HARP_KEEP, HARP_RANDOM = "harp-keep", "harp-random"  # HARP keeping its top retrieval heads; k random heads (11)
HARP_KINDS = (HARP, HARP_BI, HARP_MEAN, HARP_KEEP, HARP_RANDOM)  # the bypass variants; HARP is always measured
RELEASE = "release"  # a recipe budget: the release scripts' (HARP_FLAP, `pruning.release`): HARP's part, then FLAP's
LIKE = "like"  # a recipe budget: the parameters another point (the step's input "like") really removed
KEPT = (HARP_KEEP, HARP_RANDOM)  # their α's come from a search with the kept heads: {"alphas", "keep_heads"}
BYPASS = {HARP_MEAN: "mean"}  # the bypass of each HARP variant that is not the identity
FIDELITY = ("kl", "delta_nll", "top1_agreement")  # per enwiki-test window, against dense
LAMBADA = "lambada_openai"
BEST = "best"  # where a study names points: the baseline closest to dense on enwiki KL (see best_baseline)
TASK_BATCH = 8  # lm-eval requests per forward
TIMING_GROUP = 6  # pruned models timed in one round-robin with dense, at most (their copies are held at once)
# what dense and a timing group's copies may hold at once (weights not shared with dense, a KV cache at the long length
# each): Qwen2.5-Coder-1.5B in fp32 (7.1 GB) with one MLP-pruned copy (3.5-4.5 GB) already fills it, so such a copy
# is timed alone (15.0 GB peak measured with an 8k prefill), while HARP variants and attention drops, which add
# little beyond their caches, are timed together
COPIES_BYTES = 12 * 10**9


def label(method: str, scope: str) -> str:
    """A point's name in tables: the method, plus the scope where the method has more than one."""
    return f"{method} [{scope}]" if len(SCOPES.get(method, ())) > 1 else method


def variants(specs: list[str]) -> list[tuple[str, str]]:
    """(method, scope) pairs from specs "method" (all its scopes) or "method:scope"; ["all"] means every baseline,
    harp-bi and harp-mean. HARP itself is always measured."""
    names = [*METHODS, HARP_BI, HARP_MEAN]
    specs = names if list(specs) == ["all"] else specs
    out = []
    for method, _, scope in (spec.partition(":") for spec in specs):
        if method in (HARP_BI, HARP_MEAN):
            out.append((method, "attention"))
            continue
        if method not in SCOPES:
            raise ValueError(f"unknown method '{method}' in METHODS; choose from {', '.join(names)}")
        scopes = [scope] if scope else list(SCOPES[method])
        bad = [s for s in scopes if s not in SCOPES[method]]
        if bad:
            raise ValueError(f"method '{method}' has no scope '{bad[0]}'; valid: {', '.join(SCOPES[method])}")
        out += [(method, s) for s in scopes]
    return out


def check_named(name: str, wanted: list[str], methods: list[str]) -> None:
    """Refuse a list of points (parameter `name`) that names one not measured: dense, harp, best or a method of
    `methods` (the METHODS parameter)."""
    measured = {DENSE, HARP, BEST} | {m for m, _ in variants(methods)} | {label(*v) for v in variants(methods)}
    bad = [m for m in wanted if m not in measured]
    if bad:
        raise ValueError(f"{name} names '{bad[0]}', which is not measured: use dense, harp, best or a method of "
                         f"METHODS ({', '.join(methods)})")


# ---------------------------------------------------------------------------------------------- what is pruned
def real_drops(config, plans: dict, levels: list[int], quarter: int) -> dict:
    """HARP's real parameter drop at each level, and the paper's Q + K budget at quarter depth (under PAPER)."""
    fp = fingerprint(config)
    from_plan = {n: param_report(config, HarpPlan(fp, plans[n])) for n in levels}
    return {n: r["params_removed"] for n, r in from_plan.items()} | {PAPER: from_plan[quarter]["removed_paper"]}


def build(dense, recipe: dict, calib, *, share: bool = False):
    """A pruned copy of `dense` and the baseline's record (None for HARP). `share`: for a copy only measured beside
    `dense`, the weights pruning keeps are `dense`'s own tensors (`sharing_copy`); without it the copy owns all of its
    weights and may be trained (recovery)."""
    trim_heap()  # the last point's copy and activations go back to the system before this one is built
    if recipe["method"] == HARP_FLAP:
        return harp_flap(dense, recipe["alphas"], recipe["flap_budget"], calib, share=share)
    if "alphas" not in recipe:
        return pruned_copy(dense, recipe["method"], recipe["budget"], calib, recipe["scope"], progress=False,
                           share=share)
    model = sharing_copy(dense) if share else copy.deepcopy(dense)
    apply_harp(model, sorted(recipe["alphas"]), recipe["alphas"], meta={"method": recipe["method"]},
               bypass=BYPASS.get(recipe["method"], "identity"), keep_heads=recipe.get("keep_heads"))
    return model, None


# ---------------------------------------------------------------------------------------------- tables
def best_baseline(fidelity: pd.DataFrame) -> str:
    """The label of the structured baseline (neither a HARP variant, nor HARP + FLAP, nor unstructured Wanda, which
    removes no parameter) with the lowest mean enwiki KL; "" when none was measured."""
    fid = fidelity[~fidelity.method.isin(HARP_KINDS + UNSTRUCTURED + (HARP_FLAP,))]
    if fid.empty:
        return ""  # no structured baseline measured: `best` names no point
    means = fid.assign(point=[label(m, s) for m, s in zip(fid.method, fid.scope, strict=True)]).groupby("point").kl
    return str(means.mean().idxmin())


def chosen_rows(rows: list[dict], names: list[str], best: str) -> list[dict]:
    """The measured points named in `names` (a method, a method's label, or BEST for the label `best`)."""
    wanted = {best if n == BEST else n for n in names}
    return [r for r in rows if r["method"] in wanted or label(r["method"], r["scope"]) in wanted]


def run_table(name: str, rows: list[dict], speed: dict | None = None) -> pd.DataFrame:
    """One row per point: its cost (budget, parameters removed, weights zeroed) and shape, beside its measured speed
    (`speed`: {shape: speed row}; None when the shapes are timed later, see `with_speeds`)."""
    return pd.DataFrame([{k: v for k, v in r.items() if k not in ("record", "alphas", "keep_heads")}
                         | ({} if speed is None else speed[r["shape"]]) for r in rows]).assign(model=name)


def with_speeds(runs: pd.DataFrame, speed: dict) -> pd.DataFrame:
    """`runs` with its speed columns replaced by those of each row's shape in `speed` ({shape: speed row}, dense's
    under DENSE), as `speeds` returns them."""
    missing = sorted(set(runs["shape"]) - set(speed))
    if missing:
        raise ValueError(f"{len(missing)} shapes of the points have no timing (first: {missing[0][:80]}); time them "
                         f"with `speeds` first")
    timed = pd.DataFrame([speed[s] for s in runs["shape"]], index=runs.index)
    return pd.concat([runs.drop(columns=[c for c in timed.columns if c in runs.columns]), timed], axis=1)


# ---------------------------------------------------------------------------------------------- speed
def rebuild(dense, row: dict):
    """The pruned model of a measured point, from its record or α's (no calibration needed), for inference beside
    `dense`: the weights pruning keeps as they are are `dense`'s own (`sharing_copy`), so timing and task scoring
    hold one set of them, not two."""
    if row["method"] == HARP_FLAP:
        return harp_flap_again(dense, row["alphas"], row["record"])
    if row["record"] is not None:
        return shared_copy(dense, row["record"])
    model = sharing_copy(dense)
    apply_harp(model, sorted(row["alphas"]), row["alphas"], bypass=BYPASS.get(row["method"], "identity"),
               keep_heads=row.get("keep_heads"))
    return model


def pack_groups(sizes: dict[str, int], room: int, most: int) -> list[list[str]]:
    """Names in groups of at most `most` whose sizes add up to at most `room` (one larger than `room` goes alone):
    each name, in order, joins the first group it fits (first fit), so where everything fits the groups are the
    consecutive chunks of `most`."""
    if most < 1:
        raise ValueError(f"a group holds at least one model, got most={most}")
    groups: list[list[str]] = []
    used: list[int] = []
    for name, size in sizes.items():
        fits = [g for g in range(len(groups)) if len(groups[g]) < most and used[g] + size <= room]
        if fits:
            groups[fits[0]].append(name)
            used[fits[0]] += size
        else:
            groups.append([name])
            used.append(size)
    return groups


def timing_groups(dense, builders: dict[str, Callable], long: int, budget: int = COPIES_BYTES) -> list[list[str]]:
    """The round-robins `speeds` times, each of at most TIMING_GROUP copies, packed in order (`pack_groups`) so that
    dense and a group's copies hold at most `budget` bytes at once: the weights each copy does not share with dense
    (`held_bytes`, measured by building the copy once) and one dense-sized KV cache of `long` tokens per model. HARP
    variants, which share every weight they keep, go together; a 1.5B model's channel-pruned copies one at a time."""
    cache = kv_bytes_formula(dense.config, long, dtype=next(dense.parameters()).dtype)
    sizes = {}
    for name, build in builders.items():
        sizes[name] = held_bytes(build(), dense) + cache  # the copy is freed at once
    trim_heap()
    return pack_groups(sizes, budget - held_bytes(dense) - cache, TIMING_GROUP)


SPEED_COLUMNS = ("speedup_2k", "speedup_8k", "decode_speedup_8k", "decode_tokens_per_s_8k", "kv_bytes_per_token")


def speed_row(fast: dict, slow: dict, long: int) -> dict:
    """The CSV's speed columns from the two timed lengths (named 2k and 8k after the full profile's lengths)."""
    return {"speedup_2k": fast["prefill_speedup"], "speedup_8k": slow["prefill_speedup"],
            "decode_speedup_8k": slow["decode_speedup"], "decode_tokens_per_s_8k": slow["decode_tokens_per_s"],
            "kv_bytes_per_token": slow["kv_bytes"] / long}


# ---------------------------------------------------------------------------------------------- steps
MEMORY_FACTOR = 3  # a step holds dense, one pruned copy's own weights and activations: ~3 model sizes at most
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def setup_of(params, name: str) -> dict:
    """What every step of a model depends on: the model, its dtype and device, and the calibration and evaluation
    windows (one spec from the study to the pruner)."""
    return {"model": name, "dtype": params.dtype, "device": params.device, "n_calib": params.n_calib,
            "calib_len": params.calib_len, "n_eval": params.n_eval, "eval_len": params.eval_len,
            "seed": params.seed}


@dataclass
class ModelSteps:
    """Declares one model's steps of a study into `graph`: each step gets the model's setup in its key and the
    resources a step on this model needs (memory from its size, a GPU on cuda)."""

    graph: Graph
    notebook: str
    setup: dict
    num_layers: int
    params: int

    @classmethod
    def open(cls, graph: Graph, params, name: str) -> ModelSteps:
        shape = model_shape(name)
        return cls(graph, params.NOTEBOOK, setup_of(params, name), shape["num_layers"], shape["params"])

    def add(self, fn: Callable, key: dict, needs: dict | None = None, label: str = "", *, alone: bool = False,
            size: float = 1.0) -> str:
        """Declare `fn(key, inputs)` (a function of this module or a study's) as a step; returns its id."""
        memory = MEMORY_FACTOR * self.params * DTYPE_BYTES.get(self.setup["dtype"], 4)
        step = Step(self.notebook, f"{fn.__module__}:{fn.__name__}", {"setup": self.setup, **key}, needs or {},
                    f"{self.setup['model']}: {label}", gpus=int(self.setup["device"].startswith("cuda")),
                    memory=memory, alone=alone, size=size * self.params / 1e8)
        return self.graph.add(step)

    def search(self, deepest: int, bypass: str = "identity") -> str:
        """The greedy top-down α search of the deepest `deepest` layers (every shallower top-N's α's are its first
        N)."""
        layers = list(range(self.num_layers - deepest, self.num_layers))
        return self.add(search_step, {"layers": layers, "bypass": bypass}, label=f"search {bypass} top-{deepest}",
                        size=deepest * self.setup["n_calib"] * self.setup["calib_len"] / 256)

    def bi_search(self, n: int) -> str:
        """harp-bi's α's: the n layers of lowest attention block influence, searched."""
        return self.add(search_step, {"bi": n, "bypass": "identity"}, label=f"search harp-bi {n}",
                        size=n * self.setup["n_calib"] * self.setup["calib_len"] / 256)

    def point(self, recipe: dict, plan: str, alphas: str | None, tasks: list[str], limit) -> str:
        """A point built and measured: `recipe` (method, scope, level, n_layers, budget: "N", PAPER, RELEASE or
        {"attention_layers": m}; see `recipe_of`), its budget from the identity search `plan`, a HARP variant's α's
        from `alphas` (a search step), and `tasks`."""
        needs = {"plan": plan} | ({"alphas": alphas} if alphas else {})
        size = self.setup["n_eval"] * self.setup["eval_len"] / 512 + _items(limit, tasks, self.setup["model"]) / 20
        return self.add(point_step, {"recipe": recipe, "tasks": list(tasks), "limit": limit}, needs,
                        f"point {label(recipe['method'], recipe['scope'])} {recipe['level']}", size=size)

    def scored(self, point: str | dict, tasks: list[str], limit, shots: int = 0, label_: str = "") -> str:
        """More tasks on dense (`point` = DENSE), one point (a point step's id), or BEST: {"best": [point ids]}, the
        structured baseline closest to dense on KL among them."""
        if point == DENSE:
            needs, which = {}, DENSE
        elif isinstance(point, dict):
            needs, which = {f"p{k}": i for k, i in enumerate(point["best"])}, BEST
        else:
            needs, which = {"p0": point}, "point"
        size = _items(limit, tasks, self.setup["model"]) * (1 + shots) / 20
        return self.add(scored_step, {"which": which, "tasks": list(tasks), "limit": limit, "shots": shots}, needs,
                        f"tasks {label_ or which} {','.join(tasks)[:40]}", size=size)

    def timing(self, points: list[str], speed: dict, pairs_first: bool) -> str:
        """Every distinct shape of `points` timed against dense at two prompt lengths: alone on its node."""
        size = len(points) * speed["speed_lens"][1] / 600  # a 2k and an 8k prefill per shape beside dense
        return self.add(timing_step, {"speed": speed, "pairs_first": pairs_first},
                        {f"p{k}": i for k, i in enumerate(points)}, "timing", alone=True, size=size)


def _items(limit, tasks: list[str], model: str) -> int:
    """How many task items a limit asks for (for size estimates)."""
    limit = limits_for(limit, model)
    if isinstance(limit, dict):
        return sum(int(limit.get(t, 100) or 0) for t in tasks)
    return len(tasks) * int(limit or 100)


def search_step(key: dict, inputs: dict) -> dict:
    """{layer: α}: the greedy search of key's layers (or harp-bi's `bi` layers of lowest block influence)."""
    setup = key["setup"]
    dense, calib = context.dense(setup)[0], context.windows(setup, "train")
    layers = key.get("layers") or lowest_layers(layer_scores(dense, calib), "bi_attn", key["bi"])
    return search_alphas(dense, calib, layers, **({} if key["bypass"] == "identity" else {"bypass": key["bypass"]}))


def top(alphas: dict, n: int, num_layers: int) -> dict:
    """The α's of the top n layers from a search of the deepest layers."""
    return {i: alphas[i] for i in range(num_layers - n, num_layers)}


def recipe_of(key: dict, inputs: dict, config) -> dict:
    """A point step's full recipe: its budget (HARP's real drop at its level, the paper's Q + K at `paper`, the
    parameters of m whole attention sub-layers at {"attention_layers": m}, the release budget at RELEASE with FLAP's
    share in "flap_budget", or at LIKE what the input point "like" really removed) and a HARP variant's α's (and kept
    heads)."""
    r, L = dict(key["recipe"]), fingerprint(config)["num_layers"]
    n, budget = r["n_layers"], r.pop("budget")
    drops = real_drops(config, {n: top(inputs["plan"], n, L)}, [n], n)
    if isinstance(budget, dict):  # what dropping the top m attention sub-layers removes (α = 0), norms included
        dropped = HarpPlan(fingerprint(config), dict.fromkeys(range(L - budget["attention_layers"], L), 0.0))
        r["budget"] = param_report(config, dropped)["params_removed"]
    elif budget == LIKE:
        r["budget"] = inputs["like"][0]["params_removed"]
    elif budget == RELEASE:  # the paper's convention: HARP's Q + K (and V + O where α = 0), FLAP the rest
        both = budgets(config, HarpPlan(fingerprint(config), top(inputs["plan"], n, L)))
        r["budget"], r["flap_budget"] = both["release"], both["release"] - both["harp"]
    else:
        r["budget"] = drops[PAPER] if budget == PAPER else drops[n]
    if r["method"] in (HARP, HARP_FLAP):
        r["alphas"] = top(inputs["plan"], n, L)
    elif r["method"] == HARP_MEAN:
        r["alphas"] = top(inputs["alphas"], n, L)
    elif r["method"] == HARP_BI:
        r["alphas"] = inputs["alphas"]
    elif r["method"] in KEPT:
        r["alphas"], r["keep_heads"] = inputs["alphas"]["alphas"], inputs["alphas"]["keep_heads"]
    return r


def task_items(name: str, tok, model, tasks: list[str], limit, shots: int = 0) -> list[dict]:
    """Per-item results of `tasks` on `model` (`shots`-shot, zero by default; the fast scorer)."""
    found: list = []
    if tasks:
        # no lm-eval stderr: only the items are kept, and its bootstrap forks a pool that can hang in a Ray worker
        run_tasks(model, tok, tasks, limits_for(limit, name), num_fewshot=shots, batch_size=TASK_BATCH,
                  items=found, verbose=False, bootstrap_iters=0)
    return found


def point_step(key: dict, inputs: dict) -> tuple[dict, pd.DataFrame, list]:
    """Prune one point and measure its quality: (row, fidelity per window, task items). The row keeps the
    baseline's record or the variant's α's, so later steps rebuild the point without pruning again."""
    setup = key["setup"]
    dense, tok = context.dense(setup)
    recipe = recipe_of(key, inputs, dense.config)
    model, record = build(dense, recipe, context.windows(setup, "train"), share=True)
    fid = fidelity_windows(dense, model, context.windows(setup, "test"), ref_states=context.states(setup),
                           progress=False)
    found = task_items(setup["model"], tok, model, key["tasks"], key["limit"])
    row = {k: recipe[k] for k in ("method", "scope", "level", "n_layers")} | {
        "budget_params": recipe["budget"], "params_removed": n_params(dense) - n_params(model),
        "weights_zeroed": 0 if record is None else record.weights_zeroed, "shape": shape_key(model, record),
        "record": record, "alphas": recipe.get("alphas"), "keep_heads": recipe.get("keep_heads")}
    return row, fid.assign(method=recipe["method"], scope=recipe["scope"], level=recipe["level"]), found


def best_point(points: list[tuple]) -> tuple | None:
    """Of measured points (point step results), the structured baseline closest to dense on mean enwiki KL."""
    fidelity = pd.concat([p[1] for p in points], ignore_index=True)
    best = best_baseline(fidelity)
    return next((p for p in points if label(p[0]["method"], p[0]["scope"]) == best), None)


def scored_step(key: dict, inputs: dict) -> dict:
    """{"point": (method, scope, level) or None for dense, "items": per-item results of key's tasks}."""
    setup = key["setup"]
    dense, tok = context.dense(setup)
    if key["which"] == DENSE:
        row = None
    elif key["which"] == BEST:
        found = best_point([inputs[f"p{k}"] for k in range(len(inputs))])
        if found is None:
            return {"point": None, "items": [], "none": True}  # no structured baseline measured: `best` is empty
        row = found[0]
    else:
        row = inputs["p0"][0]
    model = dense if row is None else rebuild(dense, row)
    items = task_items(setup["model"], tok, model, key["tasks"], key["limit"], key["shots"])
    return {"point": None if row is None else (row["method"], row["scope"], row["level"]), "items": items}


def timing_step(key: dict, inputs: dict) -> dict[str, dict]:
    """{shape: speed row} of every distinct shape of the input points and of dense (DENSE), each group of shapes
    (`timing_groups`) timed in one round-robin with dense at both prompt lengths. With `pairs_first`, identity HARP
    and harp-mean of each level come first, side by side, so each pair shares a round-robin."""
    setup, speed = key["setup"], key["speed"]
    dense = context.dense(setup)[0]
    first = {r["shape"]: r for r in timed_order([inputs[f"p{k}"][0] for k in range(len(inputs))],
                                                   key["pairs_first"])}
    builders = {s: (lambda s=s: rebuild(dense, first[s])) for s in first}
    lens = tuple(speed["speed_lens"])
    timed = time_shapes(dense, builders, lens, repeats=speed["speed_repeats"], seed=setup["seed"],
                        decode_steps=speed["decode_steps"], groups=timing_groups(dense, builders, lens[1]),
                        desc=f"{setup['model']}: timing")
    return {DENSE if k == REFERENCE else k: speed_row(*v, lens[1]) for k, v in timed.items()}


def timed_order(rows: list[dict], pairs_first: bool) -> list[dict]:
    """The rows a timing builds, one per distinct shape (its first point). With `pairs_first`, identity HARP and
    harp-mean of each level come first, by depth, side by side, so each pair shares a round-robin
    (`timing_groups` fills groups of TIMING_GROUP, an even number, in order)."""
    if pairs_first:
        pair = [r for r in rows if r["method"] in (HARP, HARP_MEAN) and r["level"].startswith("N=")]
        pair = sorted(pair, key=lambda r: (r["n_layers"], r["method"]))
        rows = pair + [r for r in rows if not any(r is q for q in pair)]
    first: dict = {}
    for r in rows:
        first.setdefault(r["shape"], r)
    return list(first.values())


def speed_settings(params) -> dict:
    """The timing's parameters (a timing step's key)."""
    return {"speed_lens": list(params.speed_lens), "speed_repeats": params.speed_repeats,
            "decode_steps": params.decode_steps}


def points_of(results: dict, ids: list[str]) -> tuple[list[dict], list[pd.DataFrame], list[list]]:
    """(rows, fidelity tables, task items) of point steps, in order."""
    found = [results[i] for i in ids]
    return [f[0] for f in found], [f[1] for f in found], [f[2] for f in found]


def item_rows(name: str, method: str, scope: str, level: str, found: list) -> list[dict]:
    """Task items as the study's item rows."""
    return [dict(model=name, method=method, scope=scope, level=level, **r) for r in found]


def level_steps(ms: ModelSteps, chosen: list[tuple[str, str]], n: int, tasks: list[str], limit) -> dict:
    """One level's steps (the top n layers): the searches (HARP, and harp-bi's and harp-mean's where chosen) and a
    point per recipe, HARP first, each chosen (method, scope) at HARP's real drop. Returns their ids: search, and
    points in recipe order."""
    ids = {"search": ms.search(n)}
    alphas = {}
    if HARP_BI in dict(chosen):
        alphas[HARP_BI] = ms.bi_search(n)
    if HARP_MEAN in dict(chosen):
        alphas[HARP_MEAN] = ms.search(n, "mean")
    level = f"N={n}"
    recipes = [dict(method=HARP, scope="attention", level=level, n_layers=n, budget="N")]
    recipes += [dict(method=m, scope=s, level=level, n_layers=n, budget="N") for m, s in chosen]
    ids["points"] = [ms.point(r, ids["search"], alphas.get(r["method"]), tasks, limit) for r in recipes]
    ids["extra"] = list(alphas.values())
    return ids


def chosen_steps(ms: ModelSteps, points: list[str], names: list[str], tasks: list[str], limit, shots: int = 0
                 ) -> list[tuple[str, str]]:
    """Scoring steps of `tasks` on dense and on the points named in `names` (a method, a label, or BEST: the
    structured baseline closest to dense on KL among `points`): [(role, step id)], role "dense", a point id, or
    BEST."""
    out = [(DENSE, ms.scored(DENSE, tasks, limit, shots))]
    for i in points:
        r = ms.graph.steps[i].key["recipe"]
        if r["method"] in names or label(r["method"], r["scope"]) in names:
            out.append((i, ms.scored(i, tasks, limit, shots, label_=label(r["method"], r["scope"]))))
    if BEST in names:
        structured = [i for i in points if ms.graph.steps[i].key["recipe"]["method"] not in (*HARP_KINDS, HARP_FLAP)]
        out.append((BEST, ms.scored({"best": structured}, tasks, limit, shots, label_="best")))
    return out


def chosen_items(name: str, results: dict, points: list[str], chosen: list[tuple[str, str]]) -> list[dict]:
    """The item rows of `chosen_steps`' results: dense first, then the chosen points in the order of `points` (the
    best baseline at its own place, once)."""
    found = {role: results[i] for role, i in chosen}
    items = [dict(model=name, method=DENSE, scope="", level="", **r) for r in found.pop(DENSE, {"items": []})["items"]]
    best = found.pop(BEST, None)
    best_at = None if best is None or best.get("none") else tuple(best["point"])
    for i in points:
        row = results[i][0]
        at = (row["method"], row["scope"], row["level"])
        if i in found:
            part = found[i]
        elif best_at == at:
            part = best
        else:
            continue
        if at == best_at:
            best_at = None  # named and best: scored once in the old walk, listed once here
        items += item_rows(name, *at, part["items"])
    return items
