"""Building and measuring points: HARP variants and baselines pruned from one dense model, each measured against it.

A point is a recipe (method, scope, level, n_layers, budget, and α's for HARP variants). `ModelRun` holds what every
point of one model is measured against: the dense model, the calibration windows (the α searches and data-driven
baselines), the evaluation windows with their dense final states (dense runs once per window, not once per point),
and where each step of the run is stored (`report.parts`), so an interrupted run resumes at its first missing step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import pandas as pd
from tqdm.auto import tqdm

from ..data.corpora import ppl_windows
from ..eval.fidelity import fidelity_windows, reference_states
from ..eval.tasks import limits_for, run_tasks
from ..measure.timing import REFERENCE, kv_bytes_formula, shape_key, time_shapes, trim_heap
from ..method.accounting import param_report
from ..method.harp import HarpPlan, apply_harp
from ..method.layer_choice import layer_scores, lowest_layers
from ..method.search import search_alphas
from ..model.adapter import fingerprint
from ..model.weights import held_bytes, n_params, sharing_copy
from ..pruning.methods import METHODS, SCOPES, UNSTRUCTURED
from ..pruning.prune import pruned_copy, shared_copy
from ..report.parts import stored_part, stored_step

DENSE, HARP, HARP_BI, HARP_MEAN, PAPER = "dense", "harp", "harp-bi", "harp-mean", "paper"
HARP_KINDS = (HARP, HARP_BI, HARP_MEAN)  # the bypass variants; HARP itself is always measured
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


def settings_of(params, exempt: bool = False) -> dict:
    """The parameters a stored part or step depends on (not which models run, nor whether to reuse). With `exempt`,
    also not those in the parameter class's EXEMPT: parameters that only the parts and steps naming them in their own
    key read (so adding one keeps every stored part and step of a long run)."""
    skip = ("models", "reuse_parts", *(getattr(params, "EXEMPT", ()) if exempt else ()))
    return {k: v for k, v in asdict(params).items() if k not in skip}


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


@dataclass
class ModelRun:
    """One model's share of a comparison: the dense model, its tokenizer, calibration and evaluation windows, the
    dense final states of the evaluation windows, the study's parameters (a dataclass with seed, speed_lens,
    speed_repeats, decode_steps, reuse_parts and NOTEBOOK), `tasks_for(recipe) -> (tasks, limit)`, and the
    provenance of every stored step made or reused so far."""

    name: str
    dense: object
    tok: object
    calib: object
    windows: object
    states: list
    params: object
    tasks_for: Callable[[dict], tuple[list[str], object]]
    made: list = field(default_factory=list)

    def step(self, what: dict, compute):
        """compute()'s result, stored per model, `what` and parameters: an interrupted run resumes after it."""
        key = {"model": self.name, "step": what, **settings_of(self.params, exempt=True)}
        return stored_step(self.params.NOTEBOOK, key, compute, self.params.reuse_parts, self.made)


def open_run(name: str, dense, tok, params, tasks_for: Callable, states: bool = True) -> ModelRun:
    """A model's run: calibration windows (n_calib × calib_len enwiki-train tokens), evaluation windows (n_eval ×
    eval_len enwiki-test tokens) and, with `states`, the dense model's final states on them (for fidelity)."""
    calib = ppl_windows(tok, "enwiki", "train", params.n_calib, params.calib_len, params.seed)
    windows = ppl_windows(tok, "enwiki", "test", params.n_eval, params.eval_len, params.seed)
    return ModelRun(name, dense, tok, calib, windows, reference_states(dense, windows) if states else [], params,
                    tasks_for)


# ---------------------------------------------------------------------------------------------- what is pruned
def top_plans(run: ModelRun, levels: list[int], bypass: str = "identity") -> dict:
    """{N: α's of the top N} for each N of `levels`, from one greedy top-down search of the deepest N (so every
    shallower top-N's α's are its first N), stored as a step."""
    L = fingerprint(run.dense.config)["num_layers"]
    deepest = list(range(L - max(levels), L))
    what = {"search": deepest} | ({} if bypass == "identity" else {"bypass": bypass})
    alphas = run.step(what, lambda: search_alphas(run.dense, run.calib, deepest, bypass=bypass))
    return {n: {i: alphas[i] for i in range(L - n, L)} for n in levels}


def bi_plan(run: ModelRun, n_layers: int) -> dict:
    """harp-bi's {layer: α}: the n_layers layers of lowest attention block influence, α's searched for them."""
    return run.step({"search": HARP_BI}, lambda: search_alphas(
        run.dense, run.calib, lowest_layers(layer_scores(run.dense, run.calib), "bi_attn", n_layers)))


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
    if "alphas" not in recipe:
        return pruned_copy(dense, recipe["method"], recipe["budget"], calib, recipe["scope"], progress=False,
                           share=share)
    model = sharing_copy(dense) if share else copy.deepcopy(dense)
    apply_harp(model, sorted(recipe["alphas"]), recipe["alphas"], meta={"method": recipe["method"]},
               bypass=BYPASS.get(recipe["method"], "identity"))
    return model, None


def level_points(run: ModelRun, chosen: list[tuple[str, str]], n: int) -> tuple[list[dict], dict, dict]:
    """The recipes of one level (the top n layers): HARP, and each chosen (method, scope) at HARP's real drop, HARP
    variants with their own α's (each search a stored step). Returns (recipes, {variant: α's}, {"harp_drop": n})."""
    plans = {HARP: top_plans(run, [n])[n]}
    if HARP_BI in dict(chosen):
        plans[HARP_BI] = bi_plan(run, n)
    if HARP_MEAN in dict(chosen):
        plans[HARP_MEAN] = top_plans(run, [n], bypass="mean")[n]
    drop = real_drops(run.dense.config, {n: plans[HARP]}, [n], n)[n]
    level = f"N={n}"
    recipes = [dict(method=HARP, scope="attention", level=level, n_layers=n, budget=drop, alphas=plans[HARP])]
    for method, scope in chosen:
        extra = {"alphas": plans[method]} if method in HARP_KINDS else {}
        recipes.append(dict(method=method, scope=scope, level=level, n_layers=n, budget=drop, **extra))
    return recipes, plans, {"harp_drop": drop}


# ---------------------------------------------------------------------------------------------- quality
def task_items(run: ModelRun, model, tasks: list[str], limit, shots: int = 0) -> list[dict]:
    """Per-item results of `tasks` on `model` (`shots`-shot, zero by default; the fast scorer)."""
    found: list = []
    if tasks:
        run_tasks(model, run.tok, tasks, limits_for(limit, run.name), num_fewshot=shots, batch_size=TASK_BATCH,
                  items=found, verbose=False)
    return found


def measure(run: ModelRun, recipe: dict) -> tuple[dict, pd.DataFrame, list]:
    """Prune one point and measure its quality: (run row, fidelity per window, task items)."""
    model, record = build(run.dense, recipe, run.calib, share=True)
    fid = fidelity_windows(run.dense, model, run.windows, ref_states=run.states, progress=False)
    found = task_items(run, model, *run.tasks_for(recipe))
    row = {k: recipe[k] for k in ("method", "scope", "level", "n_layers")} | {
        "budget_params": recipe["budget"], "params_removed": n_params(run.dense) - n_params(model),
        "weights_zeroed": 0 if record is None else record.weights_zeroed, "shape": shape_key(model, record),
        "record": record, "alphas": recipe.get("alphas")}
    return row, fid, found


def measure_points(run: ModelRun, recipes: list[dict]) -> tuple[list, list, list]:
    """Measure every recipe, each a stored step: (run rows, fidelity per window, task items). A recipe with
    `same_as` (HARP at the paper level) repeats the HARP point of that level instead of measuring it again."""
    rows, fids, items = [], [], []
    for recipe in tqdm(recipes, desc=f"{run.name}: points"):
        if "same_as" in recipe:
            twin = next(r for r in rows if r["method"] == HARP and r["level"] == recipe["same_as"])
            rows.append(twin | {"level": recipe["level"], "budget_params": recipe["budget"]})
            fids.append(fids[rows.index(twin)].assign(level=recipe["level"]))
            items += [i | {"level": recipe["level"]} for i in items
                      if i["method"] == HARP and i["level"] == twin["level"]]
            continue
        row, fid, found = run.step({"point": recipe}, lambda r=recipe: measure(run, r))
        rows.append(row)
        fids.append(fid.assign(method=recipe["method"], scope=recipe["scope"], level=recipe["level"]))
        items += [dict(model=run.name, method=recipe["method"], scope=recipe["scope"], level=recipe["level"], **r)
                  for r in found]
    return rows, fids, items


def best_baseline(fidelity: pd.DataFrame) -> str:
    """The label of the structured baseline (neither a HARP variant nor unstructured Wanda, which removes no
    parameter) with the lowest mean enwiki KL; "" when none was measured."""
    fid = fidelity[~fidelity.method.isin(HARP_KINDS + UNSTRUCTURED)]
    if fid.empty:
        return ""  # no structured baseline measured: `best` names no point
    means = fid.assign(point=[label(m, s) for m, s in zip(fid.method, fid.scope, strict=True)]).groupby("point").kl
    return str(means.mean().idxmin())


def chosen_rows(rows: list[dict], names: list[str], best: str) -> list[dict]:
    """The measured points named in `names` (a method, a method's label, or BEST for the label `best`)."""
    wanted = {best if n == BEST else n for n in names}
    return [r for r in rows if r["method"] in wanted or label(r["method"], r["scope"]) in wanted]


def scored_points(run: ModelRun, rows: list[dict], tasks: list[str], limit, shots: int = 0, *,
                  dense: bool = True) -> list[dict]:
    """Per-item results of `tasks` on dense (unless `dense` is False) and on each of `rows`' points (rebuilt from
    their records or α's), one stored step per point and task set (its key names the tasks, limit and shots), as item
    rows (model, method, scope, level, task, doc_id, correct, raw)."""
    items = []
    for row in ([None] if dense else []) + list(rows):
        what = {"tasks": tasks, "limit": limit, "shots": shots,
                "point": DENSE if row is None else {k: row[k] for k in ("method", "scope", "level")}}
        found = run.step(what, lambda row=row: task_items(
            run, run.dense if row is None else rebuild(run.dense, row), tasks, limit, shots))
        method, scope, level = (DENSE, "", "") if row is None else (row["method"], row["scope"], row["level"])
        items += [dict(model=run.name, method=method, scope=scope, level=level, **r) for r in found]
    return items


def run_table(name: str, rows: list[dict], speed: dict | None = None) -> pd.DataFrame:
    """One row per point: its cost (budget, parameters removed, weights zeroed) and shape, beside its measured speed
    (`speed`: {shape: speed row}; None when the shapes are timed later, see `with_speeds`)."""
    return pd.DataFrame([{k: v for k, v in r.items() if k not in ("record", "alphas")}
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
    if row["record"] is not None:
        return shared_copy(dense, row["record"])
    model = sharing_copy(dense)
    apply_harp(model, sorted(row["alphas"]), row["alphas"], bypass=BYPASS.get(row["method"], "identity"))
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


def speeds(run: ModelRun, rows: list[dict]) -> dict[str, dict]:
    """{shape: speed-ups, decode speed and KV bytes per token} of every distinct pruned shape and of dense (DENSE),
    the shapes in `timing_groups`, each timed in one round-robin with dense at both prompt lengths and stored as a
    step."""
    p = run.params
    first = {r["shape"]: r for r in reversed(rows)}
    builders = {s: (lambda s=s: rebuild(run.dense, first[s])) for s in dict.fromkeys(r["shape"] for r in rows)}
    timed = time_shapes(run.dense, builders, tuple(p.speed_lens), repeats=p.speed_repeats, seed=p.seed,
                        decode_steps=p.decode_steps, groups=timing_groups(run.dense, builders, p.speed_lens[1]),
                        desc=f"{run.name}: timing", store=lambda names, compute: run.step({"timing": names}, compute))
    return {DENSE if k == REFERENCE else k: speed_row(*v, p.speed_lens[1]) for k, v in timed.items()}


SPEED_COLUMNS = ("speedup_2k", "speedup_8k", "decode_speedup_8k", "decode_tokens_per_s_8k", "kv_bytes_per_token")


def speed_row(fast: dict, slow: dict, long: int) -> dict:
    """The CSV's speed columns from the two timed lengths (named 2k and 8k after the full profile's lengths)."""
    return {"speedup_2k": fast["prefill_speedup"], "speedup_8k": slow["prefill_speedup"],
            "decode_speedup_8k": slow["decode_speedup"], "decode_tokens_per_s_8k": slow["decode_tokens_per_s"],
            "kv_bytes_per_token": slow["kv_bytes"] / long}


def model_parts(params, compute: Callable[[str], dict], tables: tuple[str, ...]) -> dict:
    """Each model's part, `compute(name)`, stored under the study's parameters (reused with REUSE_PARTS), and joined:
    the `tables` concatenated, infos (with each part's provenance) and seconds."""
    parts = []
    for name in params.models:
        part, made = stored_part(params.NOTEBOOK, {"model": name, **settings_of(params)},
                                 lambda name=name: compute(name), params.reuse_parts)
        parts.append(part | {"info": part["info"] | {"part": made}})
    return {**{k: pd.concat([part[k] for part in parts], ignore_index=True) for k in tables},
            "infos": [part["info"] for part in parts], "seconds": pd.DataFrame([part["seconds"] for part in parts])}
