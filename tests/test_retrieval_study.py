"""Notebook 11's own logic (issue 50), on small made-up inputs: which heads are kept, the attention drop that holds
the same KV bytes, the paired rows of figures/11_retrieval.csv and the agreement of the two scores."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import spearmanr
from transformers import AutoTokenizer

from harp_src.data.longcontext import passkey_items
from harp_src.model.loading import resolve_source
from harp_src.studies.retrieval_heads import (
    BESIDE_RELEASE,
    DEPTHS,
    KEEP_LINE,
    RetrievalParams,
    choose_heads,
    exact_count,
    k_of,
    kv_layers_freed,
    passkey_prompts,
    point_names,
    retrieval_graph,
    retrieval_table,
    score_agreement,
    share,
)


def scores(n_layers=4, n_heads=4) -> pd.DataFrame:
    rows = [dict(layer=i, head=h, kv_group=h // 2, retrieval=(i * n_heads + h) / 100, copy_paste=0.0,
                 taylor=float((h * 7 + i) % 5), lrp=-(i * n_heads + h) / 100)
            for i in range(n_layers) for h in range(n_heads)]
    return pd.DataFrame(rows)


def test_the_top_heads_are_the_highest_scores_of_the_pruned_layers_only():
    s = scores()
    s.loc[(s.layer == 0) & (s["head"] == 0), "retrieval"] = 9.0  # the best head sits in a layer that is not pruned
    assert choose_heads(s, [2, 3], 3, "top") == {3: [1, 2, 3]}
    assert choose_heads(s, [2, 3], 5, "top") == {2: [3], 3: [0, 1, 2, 3]}


def test_random_heads_are_seeded_distinct_and_inside_the_pruned_layers():
    s = scores()
    a, b = choose_heads(s, [2, 3], 5, "random", seed=1), choose_heads(s, [2, 3], 5, "random", seed=1)
    assert a == b and sum(len(h) for h in a.values()) == 5 and set(a) <= {2, 3}
    assert choose_heads(s, [2, 3], 5, "random", seed=2) != a
    with pytest.raises(ValueError, match="unknown head choice"):
        choose_heads(s, [2, 3], 1, "best")


def test_kept_fractions_and_the_kv_matched_attention_drop():
    assert [k_of(f, 8, 9) for f in (0.05, 0.1, 0.25)] == [4, 7, 18]  # SmolLM2's top 8 layers, 9 heads each
    assert k_of(0.01, 4, 4) == 1 and share(0.05) == "5%" and share(0.25) == "25%"
    # 8 bypassed layers of 3 KV groups (n_rep 3): one group cached in one layer, two in another, 1 layer's worth in all
    assert kv_layers_freed({22: [3, 4, 5], 23: [6, 0]}, 8, 3, 3) == 7
    assert kv_layers_freed({22: [0]}, 4, 4, 1) == 3  # MQA: one kept head keeps the whole layer's K/V
    assert kv_layers_freed({i: [0] for i in range(4)}, 4, 4, 1) == 1  # at least one layer is dropped


def test_points_are_named_for_their_line():
    row = dict(method="harp-keep", scope="5%", level="N=8")
    assert point_names(row) == ("harp-keep", "harp-keep 5%")
    assert point_names(dict(method="attn-drop-top", scope="attention", level="KV of harp-keep 5%")) == \
        (KEEP_LINE, "attn-drop-top, KV of harp-keep 5%")
    assert point_names(dict(method="flap", scope="mlp", level="N=8")) == ("flap [mlp]", "flap [mlp]")
    assert point_names(dict(method="harp+flap", scope="mlp", level="release")) == ("harp+flap", "harp+flap")
    assert point_names(dict(method="flap", scope="mlp", level="release")) == (BESIDE_RELEASE["flap"],) * 2
    assert point_names(dict(method="attn-drop-top", scope="attention", level="release"))[1] == \
        "attn-drop-top of harp+flap's layers"


def study() -> dict:
    """Two items and two windows per point; harp-keep reads both items, HARP and the random control one."""
    points = ["dense", "harp", "harp-keep 5%", "harp-random 5%"]
    correct = {"dense": [1, 1], "harp": [0, 1], "harp-keep 5%": [1, 1], "harp-random 5%": [0, 1]}
    items = pd.DataFrame([dict(model="m", point=p, metric="passkey", unit=u, correct=float(correct[p][u]))
                          for p in points for u in (0, 1)])
    windows = pd.DataFrame([dict(model="m", point=p, window=w, kl=0.5 * (p != "dense") + w / 10)
                            for p in points[1:] for w in (0, 1)])
    rows = [dict(model="m", line=p.split(" ")[0], point=p, k=4 * ("5%" in p), params_removed=10, kv_bytes_per_token=1.0,
                 speedup_8k=np.nan, decode_speedup_8k=np.nan) for p in points]
    return {"points": pd.DataFrame(rows), "items": items, "windows": windows}


def test_the_table_pairs_harp_keep_with_harp_and_with_its_random_control():
    table = retrieval_table(study())
    plain = table[table.reference == ""].set_index(["method", "metric"])
    assert plain.loc[("harp-keep 5%", "passkey"), "value"] == 1.0 and plain.loc[("harp", "passkey"), "n"] == 2
    assert plain.loc[("harp", "kl"), "value"] == pytest.approx(0.55)
    paired = table[table.reference != ""].set_index(["reference", "metric"])
    assert paired.loc[("harp", "passkey"), "value"] == pytest.approx(0.5)  # harp-keep − harp on the same prompts
    assert paired.loc[("harp-random 5%", "passkey"), "value"] == pytest.approx(0.5)
    assert paired.loc[("harp", "kl"), "value"] == pytest.approx(0.0) and (paired.method == "harp-keep 5%").all()
    assert list(table.columns[:5]) == ["model", "method", "line", "k", "params_removed"]


def test_harp_flap_is_paired_with_flap_alone_and_its_layers_dropped():
    points = ["dense", "harp", "harp+flap", *BESIDE_RELEASE.values()]
    correct = {"dense": [1, 1], "harp": [0, 1], "harp+flap": [0, 0], BESIDE_RELEASE["flap"]: [1, 1],
               BESIDE_RELEASE["attn-drop-top"]: [0, 1]}
    items = pd.DataFrame([dict(model="m", point=p, metric="lambada_openai", unit=u, correct=float(correct[p][u]))
                          for p in points for u in (0, 1)])
    windows = pd.DataFrame([dict(model="m", point=p, window=w, kl=0.1 * k) for k, p in enumerate(points[1:])
                            for w in (0, 1)])
    rows = [dict(model="m", line=p, point=p, k=0, params_removed=10, kv_bytes_per_token=1.0, speedup_8k=np.nan,
                 decode_speedup_8k=np.nan) for p in points]
    table = retrieval_table({"points": pd.DataFrame(rows), "items": items, "windows": windows})
    paired = table[table.reference != ""].set_index(["reference", "metric"])
    assert (paired.method == "harp+flap").all()
    assert set(paired.index.get_level_values(0)) == set(BESIDE_RELEASE.values())
    assert paired.loc[(BESIDE_RELEASE["flap"], "lambada_openai"), "value"] == pytest.approx(-1.0)
    assert paired.loc[(BESIDE_RELEASE["attn-drop-top"], "lambada_openai"), "value"] == pytest.approx(-0.5)
    assert paired.loc[(BESIDE_RELEASE["flap"], "kl"), "value"] == pytest.approx(0.1 - 0.3)  # the last point's KL


def test_score_agreement_is_spearman_and_the_shared_top_ten():
    s = scores().assign(model="m", copy_paste=lambda d: d.retrieval[::-1].to_numpy(), pruned=lambda d: d.layer >= 2)
    a = score_agreement(s).set_index(["heads", "a", "b"])
    both = a.loc[("all layers", "induction", "copy-paste")]
    assert both.spearman == pytest.approx(-1.0) and both.top10_shared == 4 and both.p < 1e-6
    assert a.loc[("all layers", "induction", "LRP"), "spearman"] == pytest.approx(-1.0)  # LRP is -induction here
    assert a.loc[("all layers", "copy-paste", "LRP"), "top10_shared"] == 10
    taylor = a.loc[("all layers", "induction", "Taylor"), "spearman"]
    assert taylor == pytest.approx(spearmanr(s.retrieval, s.taylor).statistic)
    assert (a.xs("pruned layers").n == 8).all() and len(a) == 10


def test_bad_parameters_are_refused_before_any_model_loads():
    for bad, message in ((dict(KEEP_FRACTIONS=[0.25, 0.05]), "ascending"), (dict(KEEP_FRACTIONS=[0.0]), "ascending"),
                         (dict(BASELINES=["nope"]), "unknown method"), (dict(SPEED_LENS=[64]), "SPEED_LENS"),
                         (dict(LC_ITEMS=0), "LC_ITEMS")):
        with pytest.raises(ValueError, match=message):
            RetrievalParams.defaults(**bad).check()


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(resolve_source("smollm2-135m")[0])


def test_passkey_prompts_are_as_many_as_asked_spread_over_the_depths(tok):
    every = passkey_items(tok, (256, 320), DEPTHS, 2, seed=3)  # 2 per depth and length, in that order
    assert passkey_prompts(tok, [256, 320], 10, 3) == every  # a multiple of 5: every prompt drawn, as before
    for n in (1, 2, 7):
        drawn = passkey_items(tok, (256, 320), DEPTHS, math.ceil(n / 5), seed=3)
        got = passkey_prompts(tok, [256, 320], n, 3)
        assert [i["length"] for i in got] == [256] * n + [320] * n and all(i in drawn for i in got)
        assert len({i["answers"][0] for i in got}) == 2 * n
        assert [i["depth"] for i in got[:n]] == sorted(i["depth"] for i in got[:n])
    assert [i["depth"] for i in passkey_prompts(tok, [256], 2, 3)] == [0.1, 0.9]  # the shallowest and the deepest
    assert {i["depth"] for i in passkey_prompts(tok, [256], 7, 3)} == set(DEPTHS)
    train = passkey_prompts(tok, [256], 2, 3, split="train")  # the copy-paste score's prompts: enwiki train
    assert train == [passkey_items(tok, (256,), DEPTHS, 1, seed=3, split="train")[i] for i in (0, 4)]
    assert all(a["prompt"] != b["prompt"] for a, b in zip(train, passkey_prompts(tok, [256], 2, 3), strict=True))


def test_prompt_counts_no_multiple_of_five_are_keyed_apart_from_what_earlier_code_stored():
    """Earlier code drew at least five prompts for any count; a step it stored under a count that is no multiple of 5
    must not be reused, while multiples of 5 (the full profile's 50 and 20) keep their keys and stored steps."""
    def prompt_keys(n):
        graph = retrieval_graph(RetrievalParams.defaults(LC_ITEMS=n, COPY_ITEMS=n))[0]
        return [s.key for s in graph.steps.values() if s.fn.endswith((":reading_step", ":scores_step"))]

    assert exact_count(50) == exact_count(20) == {} and exact_count(2) == {"prompts": "exactly n"}
    five, two = prompt_keys(5), prompt_keys(2)
    assert len(five) == len(two) > 2 and all("prompts" not in k for k in five)
    assert all(k["prompts"] == "exactly n" for k in two)


def test_a_model_of_its_own_sizes_changes_its_own_steps_only():
    """MODEL_SIZES[m] declares m's steps exactly as the same sizes given to every model would; the other models keep
    their keys (so their stored steps)."""
    both = ["smollm2-135m", "gemma3-270m"]
    sizes = {"LC_ITEMS": 3, "LIMIT": {"lambada_openai": 3}, "N_CALIB": 1}

    def keys(p, model):
        return [s.spec for s in retrieval_graph(p)[0] if s.key["setup"]["model"] == model]

    shared, own = RetrievalParams.defaults(MODELS=both), RetrievalParams.defaults(MODELS=both,
                                                                                  MODEL_SIZES={"gemma3-270m": sizes})
    own.check()
    assert own.for_model("smollm2-135m") is own and own.for_model("gemma3-270m").lc_items == 3
    assert keys(own, "smollm2-135m") == keys(shared, "smollm2-135m")
    assert keys(own, "gemma3-270m") == keys(RetrievalParams.defaults(MODELS=both, **sizes), "gemma3-270m")
    assert keys(own, "gemma3-270m") != keys(shared, "gemma3-270m")


def test_bad_model_sizes_are_refused_before_any_model_loads():
    for sizes, error, message in (({"qwen2.5-coder-1.5b": {"LC_ITEMS": 2}}, ValueError, "does not list"),
                                  ({"smollm2-135m": {"SEED": 1}}, ValueError, "may set only"),
                                  ({"smollm2-135m": 3}, ValueError, "may set only"),
                                  ({"smollm2-135m": {"LC_ITEMS": "many"}}, TypeError, "LC_ITEMS"),
                                  ({"smollm2-135m": {"LC_ITEMS": 0}}, ValueError, "LC_ITEMS")):
        with pytest.raises(error, match=message):
            RetrievalParams.defaults(MODEL_SIZES=sizes).check()
