"""Bad input as a new user gives it (issue 25): each case gets one clear error (one line and exit 2 from the CLI, one
ValueError from the API), and nothing changes: not the user's files, not the current directory, not the model.

Every CLI case runs in a fresh copy of a small world: a tiny Llama as a model folder, a HARP checkpoint of it, a
plan file, a folder of the user's and a working directory with a file in it. The table rows are the cases of the
issue, one each; the tests after it show that the accepted inputs still work (overwrite, empty folder, file modes).
"""

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from conftest import make_tiny
from harp_src import HarpPlan, apply_harp, load_model, prune, runner, save_checkpoint, search_alphas
from harp_src.__main__ import main
from harp_src.checkpoints import check_save_target, save_claim
from harp_src.model.loading import resolve_source
from harp_src.pruning.record import PruneRecord, encode_mask
from harp_src.report import files
from harp_src.report.files import ROOT

ALPHAS = {2: 0.5, 3: 1.0}
MEAN_ALPHAS = {2: 0.5, 3: 0.7}


def calib(n: int = 2, t: int = 16) -> torch.Tensor:
    return torch.randint(3, 120, (n, t), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def base_world(tmp_path_factory) -> Path:
    """Built once: model folders, checkpoints and plans that each case copies."""
    root = tmp_path_factory.mktemp("world")
    tok = AutoTokenizer.from_pretrained(resolve_source("smollm2-135m")[0])
    dense = make_tiny("llama")
    dense.save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    model = make_tiny("llama")
    plan = apply_harp(model, list(ALPHAS), ALPHAS)
    save_checkpoint(model, root / "ckpt", tok)
    plan.to_json(root / "plan.json")
    flap = make_tiny("llama")
    prune(flap, "flap", 20_000, calib(), progress=False)
    save_checkpoint(flap, root / "flap", tok)
    mean = make_tiny("llama")
    apply_harp(mean, list(MEAN_ALPHAS), MEAN_ALPHAS, bypass="mean")
    save_checkpoint(mean, root / "mean", tok)
    (root / "user" / "sub").mkdir(parents=True)
    (root / "user" / "notes.txt").write_text("my notes\n")
    (root / "user" / "sub" / "results.csv").write_text("a,b\n1,2\n")
    (root / "work").mkdir()
    (root / "work" / "draft.md").write_text("# draft\n")
    (root / "afile.txt").write_text("not a folder\n")
    return root


@pytest.fixture
def world(base_world, tmp_path, monkeypatch) -> Path:
    root = tmp_path / "w"
    shutil.copytree(base_world, root)
    monkeypatch.chdir(root / "work")
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every file and folder under root, with a hash of each file's bytes and its mode."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest() + oct(p.stat().st_mode)
    return out


# ---------------------------------------------------------------------------------------------- world editors
def edit_config(path: Path, change) -> None:
    config = json.loads((path / "config.json").read_text())
    change(config)
    (path / "config.json").write_text(json.dumps(config))


def harp_alphas(alphas: dict) -> callable:
    def change(config):
        config["harp_plan"]["harp"]["alphas"] = alphas
    return change


def write_plan(w: Path, edit=None, text: str | None = None) -> str:
    plan = json.loads((w / "plan.json").read_text())
    if edit is not None:
        edit(plan)
    path = w / "bad_plan.json"
    path.write_text(text if text is not None else json.dumps(plan))
    return str(path)


def fewer_channels(config) -> None:
    layer = config["harp_plan"]["baseline"]["layers"]["1"]
    layer["channels"] = layer["channels"][:-1]
    if layer.get("channels_bias") is not None:
        layer["channels_bias"] = layer["channels_bias"]


def record_layer(layer: str, **change):
    """Edit one layer entry of a baseline checkpoint's record (None: delete that key)."""
    def edit(config):
        entry = config["harp_plan"]["baseline"]["layers"][layer]
        entry.update(change)
        for key in [k for k, v in entry.items() if v is None]:
            del entry[key]
    return edit


def record_key(key: str, value):
    def edit(config):
        config["harp_plan"]["baseline"][key] = value
    return edit


def attention_entry(config: dict, layer: int) -> dict:
    return next(e for e in config["harp_structure"] if e["path"] == f"model.layers.{layer}.self_attn")


def mean_case(change):
    """`ppl --model` on the mean-bypass checkpoint with its config.json changed."""
    return ckpt_case(lambda w: edit_config(w / "mean", change), "mean")


def flap_case(change):
    return ckpt_case(lambda w: edit_config(w / "flap", change), "flap")


def alpha_everywhere(config) -> None:
    """α 0.9 written consistently in the plan and the structure, on weights folded at 0.5."""
    attention_entry(config, 2)["alpha"] = 0.9
    config["harp_plan"]["harp"]["alphas"]["2"] = 0.9


MASK = encode_mask(torch.zeros(64, 64, dtype=torch.bool))  # q_proj of the tiny Llama: 512 bytes of bits
MASK_OF_TWO = encode_mask(torch.zeros(128, 64, dtype=torch.bool))  # twice as long


def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def plan_case(edit=None, text=None):
    return lambda w: ["ppl", "--model", str(w / "tiny"), "--plan", write_plan(w, edit, text)]


def ckpt_case(change, name: str = "ckpt"):
    def build(w):
        change(w)
        return ["ppl", "--model", str(w / name)]
    return build


def prune_to(*extra):
    return lambda w: ["prune", "--model", str(w / "tiny"), "--layers", "3", *[str(a).format(w=w) for a in extra]]


def set_key(key, value):
    def edit(plan):
        plan[key] = value
    return edit


def drop_key(key):
    def edit(plan):
        del plan[key]
    return edit


# ---------------------------------------------------------------------------------------------- the CLI table
CLI = {
    # saving never deletes what it did not write
    "save into a folder of the user's": (prune_to("--save", "{w}/user"), "is not a checkpoint of this project"),
    "save into the current directory": (prune_to("--save", "."), "it is the current directory"),
    "save onto a file": (prune_to("--save", "{w}/afile.txt"), "exists and is not a folder"),
    "save over a checkpoint without --overwrite": (prune_to("--save", "{w}/ckpt"), "Pass --overwrite"),
    "overwrite a checkpoint that holds a user's file": (
        lambda w: (w / "ckpt" / "notes.txt").write_text("mine") and prune_to("--save", "{w}/ckpt", "--overwrite")(w),
        "but also notes.txt"),
    "save into a folder above the current one": (prune_to("--save", "..", "--overwrite"), "contains the current"),
    "--out over a file that is not a plan": (prune_to("--out", "{w}/user/notes.txt"), "is not a plan file"),
    # checkpoints are checked against their plan before the weights load
    "checkpoint plan names a layer the model lacks": (
        ckpt_case(lambda w: edit_config(w / "ckpt", harp_alphas({"2": 0.5, "35": 1.0}))), "layer 35 is out of range"),
    "checkpoint plan names another layer": (
        ckpt_case(lambda w: edit_config(w / "ckpt", harp_alphas({"1": 0.5, "3": 1.0}))),
        "disagree at model.layers.1.self_attn: the plan makes it a bypass module, the structure leaves it unpruned"),
    "checkpoint plan α differs from the folded α": (
        ckpt_case(lambda w: edit_config(w / "ckpt", harp_alphas({"2": 0.9, "3": 1.0}))),
        "disagree at model.layers.2.self_attn: its alpha is 0.9 by the plan but 0.5 in the structure"),
    "checkpoint plan has no fingerprint": (
        ckpt_case(lambda w: edit_config(w / "ckpt", lambda c: c["harp_plan"]["harp"].pop("fingerprint"))),
        r"config.json \(harp_plan.harp\): a plan has the keys"),
    "checkpoint structure without a plan": (
        ckpt_case(lambda w: edit_config(w / "ckpt", lambda c: c.pop("harp_plan"))), "disagree at"),
    "baseline record disagrees with the shapes": (
        lambda w: edit_config(w / "flap", fewer_channels) or ["ppl", "--model", str(w / "flap")],
        "the record claims params_removed=19840, but its layers remove 20032"),
    "truncated config.json": (ckpt_case(lambda w: truncate(w / "ckpt" / "config.json", 300)), "is not valid JSON"),
    "config.json repeats a key": (
        ckpt_case(lambda w: (w / "ckpt" / "config.json").write_text(
            (w / "ckpt" / "config.json").read_text().replace('"fold": true', '"fold": true, "fold": false'))),
        "'fold' appears more than once"),
    "truncated model.safetensors": (
        ckpt_case(lambda w: truncate(w / "ckpt" / "model.safetensors", 1000)), r"cannot be read.*truncated"),
    "missing model.safetensors": (
        ckpt_case(lambda w: (w / "ckpt" / "model.safetensors").unlink()),
        "cannot be loaded .*no file named model.safetensors"),
    "checkpoint weights that do not match": (
        ckpt_case(lambda w: save_file({k: v for k, v in load_file(w / "ckpt" / "model.safetensors").items()
                                       if "layers.3.self_attn.v_proj" not in k},
                                      w / "ckpt" / "model.safetensors", metadata={"format": "pt"})),
        r"v_proj\.weight is missing"),
    # plans are parsed strictly, and before the model loads
    "plan repeats a layer key": (
        plan_case(text='{"fingerprint": {}, "alphas": {"3": 0.5, "3": 1.0}}'), "'3' appears more than once"),
    "plan has an alias of a layer key": (plan_case(lambda p: p["alphas"].update({"03": 0.2})), "not a plain layer"),
    "plan fold is a string": (plan_case(set_key("fold", "false")), "fold must be true or false"),
    "plan alphas are empty": (plan_case(set_key("alphas", {})), "alphas is empty"),
    "plan α is null": (plan_case(lambda p: p["alphas"].update({"3": None})), r"α must be a number in \[0, 1\]"),
    "plan α is out of range": (plan_case(lambda p: p["alphas"].update({"3": 1.5})), r"α must be a number in \[0, 1\]"),
    "plan alphas are a list": (plan_case(set_key("alphas", [0.5, 1.0])), "must be a {layer: α} mapping"),
    "plan has no fingerprint": (plan_case(drop_key("fingerprint")), r"missing \['fingerprint'\]"),
    "plan has an unknown key": (plan_case(set_key("alpha", {"3": 0.5})), r"unknown \['alpha'\]"),
    "plan is not JSON": (plan_case(text="{'alphas': "), "is not valid JSON"),
    "plan is for another model": (
        plan_case(lambda p: p["fingerprint"].update(num_layers=30)), "bad_plan.json: this plan was made for another"),
    "plan names a layer the model lacks": (plan_case(lambda p: p["alphas"].update({"9": 0.5})),
                                           "bad_plan.json: layer 9 is out of range"),
    "plan file is missing": (lambda w: ["ppl", "--model", str(w / "tiny"), "--plan", str(w / "nope.json")],
                             "plan file .*nope.json does not exist"),
    "plan path is a folder": (lambda w: ["ppl", "--model", str(w / "tiny"), "--plan", str(w / "user")],
                              "is a folder"),
    # the other commands' arguments
    "alphas that are not numbers": (prune_to("--alphas", "3=x"), "--alphas '3=x'"),
    "alphas that give a layer twice": (prune_to("--alphas", "3=0.5,3=0.2"), "layer 3 is given twice"),
    "alphas for other layers": (prune_to("--alphas", "2=0.5"), "missing \\[3\\], extra \\[2\\]"),
    "layers that do not parse": (lambda w: ["prune", "--model", str(w / "tiny"), "--layers", "top:x"],
                                 "use top:N, bottom:N"),
    "layers out of range": (lambda w: ["prune", "--model", str(w / "tiny"), "--layers", "2-7"], "out of range"),
    "layers that name nothing": (lambda w: ["prune", "--model", str(w / "tiny"), "--layers", "3-2"],
                                 "no layers given"),
    "an unknown bypass": (prune_to("--bypass", "avg"), "unknown bypass 'avg': choose one of \\['identity', 'mean'\\]"),
    "a mean bypass on a plan made for the identity": (
        lambda w: ["timing", "--model", str(w / "tiny"), "--plan", str(w / "plan.json"), "--bypass", "mean"],
        "made for the identity bypass"),
    "search grid outside [0, 1]": (
        lambda w: ["search", "--model", str(w / "tiny"), "--layers", "3", "--grid", "0,2"], "--grid '0,2'"),
    "search with zero threads": (
        lambda w: ["search", "--model", str(w / "tiny"), "--layers", "3", "--threads", "0"], "threads must be"),
    "timing lengths that do not parse": (
        lambda w: ["timing", "--model", str(w / "tiny"), "--seq-lens", "a,b"], "--seq-lens must be"),
    "evalbench with no task": (lambda w: ["evalbench", "--model", str(w / "tiny"), "--tasks", ","],
                               "names no task"),
    "evalbench with zero threads": (lambda w: ["evalbench", "--model", str(w / "tiny"), "--threads", "0"],
                                    "threads must be"),
    "a model that does not exist": (lambda w: ["ppl", "--model", "not-a-model"], "packaged names"),
    "a model folder with no model": (lambda w: ["ppl", "--model", str(w / "user")], "folder without config.json"),
    # issue 48, 1: a baseline checkpoint's record is checked whole before anything is applied
    "record bias of the wrong length": (flap_case(record_layer("0", heads_bias=[0.1] * 10)),
                                        "heads_bias has 10 values, but the projection it compensates has 64 outputs"),
    "record bias of length one": (flap_case(record_layer("0", heads_bias=[0.1])), "heads_bias has 1 values"),
    "record bias that is NaN": (flap_case(record_layer("0", channels_bias=[float("nan")] * 64)),
                                "channels_bias holds a value that is not a finite number"),
    "record bias of 1e308": (flap_case(record_layer("0", heads_bias=[1e308] * 64)),
                             r"heads_bias reaches 1e\+308, beyond .* NaN"),
    "record mask truncated": (flap_case(record_layer("1", zeroed={"q_proj": MASK[:8]})),
                              "the zeroed mask of q_proj holds 6 bytes, but a 64x64 weight needs 512"),
    "record mask doubled": (flap_case(record_layer("1", zeroed={"q_proj": MASK_OF_TWO})),
                            "holds 1024 bytes, but a 64x64 weight needs 512"),
    "record with no layers": (flap_case(record_key("layers", {})), "layers is empty: a record prunes at least one"),
    "record params_removed that disagrees": (flap_case(record_key("params_removed", 5)),
                                             "claims params_removed=5, but its layers remove 19840 parameters"),
    # issue 48, 2: what plain transformers refuses too (test_plain_transformers_refuses_what_load_model_refuses)
    "mean bypass with its layer_idx moved": (mean_case(lambda c: attention_entry(c, 3).update(layer_idx=2)),
                                             "its layer_idx is 3 by the plan but 2 in the structure"),
    "mean bypass without its layer_idx": (mean_case(lambda c: attention_entry(c, 3).pop("layer_idx")),
                                          "its layer_idx is 3 by the plan but None in the structure"),
    "mean bypass without its mixing": (mean_case(lambda c: attention_entry(c, 3).pop("mixing")),
                                       "its mixing is 'mean' by the plan but None in the structure"),
    "α edited in plan and structure, not in the weights": (
        mean_case(alpha_everywhere), "layers.2.self_attn: its alpha is 0.9 in config.json, but its weights were "
                                     "folded at 0.5"),
    # issue 48, 3: every output is checked before any work, naming the user's path
    "save under a file": (prune_to("--save", "{w}/afile.txt/sub"),
                          r"afile.txt/sub cannot be written: .*afile.txt is a file, not a folder"),
    "save where nothing can be created": (prune_to("--save", "/sys/harp-ckpt"),
                                          "/sys/harp-ckpt cannot be written: no file can be created in /sys"),
    "--out where nothing can be created": (prune_to("--out", "/sys/plan.json"),
                                           "--out /sys/plan.json cannot be written"),
    "--csv that is a folder": (lambda w: ["timing", "--model", str(w / "tiny"), "--csv", str(w / "user")],
                               "--csv .*/user is a folder; give a file name"),
    # issue 48, 4: the mean bypass keeps one layer's attention
    "the mean bypass on every layer": (prune_to("--bypass", "mean", "--layers", "0-3", "--save", "{w}/new"),
                                       "the mean bypass needs at least one layer that keeps its attention"),
    "a mean search on every layer": (
        lambda w: ["search", "--model", str(w / "tiny"), "--layers", "0-3", "--bypass", "mean"],
        r"pruning layers \[0, 1, 2, 3\] would leave none of the model's 4: keep one layer's attention"),
    # issue 48, 6: messages that say what is wrong
    "a model path that does not exist": (lambda w: ["ppl", "--model", "./my-pruned"],
                                         r"\./my-pruned does not exist: there is no model folder at"),
    "a model path that is a file": (lambda w: ["ppl", "--model", str(w / "afile.txt")],
                                    "is a file, not a model folder"),
    "a plan nested 1000 deep": (plan_case(text="[" * 1000 + "]" * 1000), "nests lists or objects more than 32 deep"),
    "a plan nested 40 deep": (plan_case(lambda p: p["meta"].update(deep=json.loads("[" * 40 + "]" * 40))),
                              "more than 32 deep"),
    "a plan larger than 1 MiB": (plan_case(lambda p: p["meta"].update(note="x" * 1_100_000)),
                                 "is larger than 1,048,576 bytes"),
    "--cleanup with a command": (lambda w: ["--cleanup", str(w / "ckpt"), "ppl"], "--cleanup DIR runs alone"),
}


@pytest.mark.parametrize("case", list(CLI))
def test_cli_bad_input_is_one_line_exit_2_and_changes_nothing(case, world, capsys):
    build, message = CLI[case]
    argv = build(world)
    before = snapshot(world)
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = [line for line in captured.err.splitlines() if line.startswith("{")]
    assert len(lines) == 1 and captured.out == ""
    error = json.loads(lines[0])["error"]
    assert "\n" not in error and "Traceback" not in captured.err
    assert re.search(message, error), error
    assert snapshot(world) == before  # the user's files, the checkpoints and the current directory


def test_an_unexpected_error_keeps_its_traceback(world, monkeypatch):
    def bug(*args, **kwargs):
        raise KeyError("a bug")
    monkeypatch.setattr("harp_src.__main__.load_model", bug)
    with pytest.raises(KeyError):
        main(["ppl", "--model", str(world / "tiny")])


# ---------------------------------------------------------------------------------------------- the API table
def pruned_at_3(model):
    """The state a second call finds: layer 3 already pruned (α 0.5, folded)."""
    apply_harp(model, [3], 0.5)


RECORD = {"method": "flapp", "scope": "mlp", "budget": 1, "fingerprint": {}, "layers": {}, "params_removed": 0}
FINGERPRINT = {"family": "llama", "num_layers": 4, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}
FINGERPRINT_30 = FINGERPRINT | {"num_layers": 30}
ATTN_DROP_TOP = PruneRecord("attn-drop-top", "attention", 12_000, FINGERPRINT, {3: {"heads": []}}, 12_352)
USER = Path("user-folder")  # in the test's working directory, holding the user's notes.txt

@functools.cache
def flap_record() -> str:
    """The tiny Llama's FLAP record as JSON (layer "0" keeps one head group with a compensation bias)."""
    return json.dumps(prune(make_tiny("llama"), "flap", 20_000, calib(), progress=False).to_dict())


def apply_edited(*edits):
    """The call that applies the FLAP record with each of `edits` made to it: each is (layer or None, key, value);
    a None value deletes the key."""
    def call(model):
        record = json.loads(flap_record())
        for layer, key, value in edits:
            entry = record if layer is None else record["layers"][layer]
            entry.pop(key) if value is None else entry.update({key: value})
        PruneRecord.from_dict(record, "rec.json").apply(model)
    return call


# case: (what the model went through before, the bad call, the message)
API = {
    # issue 48: a record is checked whole, per field, before the first change
    "record: heads_bias of the wrong length": (None, apply_edited(("0", "heads_bias", [0.1] * 10)),
                                               "heads_bias has 10 values"),
    "record: heads_bias of length 1": (None, apply_edited(("0", "heads_bias", [0.1])), "heads_bias has 1 values"),
    "record: NaN channels_bias": (None, apply_edited(("0", "channels_bias", [float("nan")] * 64)), "not a finite"),
    "record: heads_bias of 1e308": (None, apply_edited(("0", "heads_bias", [1e308] * 64)), r"reaches 1e\+308"),
    "record: heads_bias of 1e30 (fp32 squares overflow)": (None, apply_edited(("0", "heads_bias", [1e30] * 64)),
                                                           r"reaches 1e\+30, beyond 2.3\de\+18"),
    "record: bias that is a bool": (None, apply_edited(("0", "heads_bias", [True] * 64)), "must be a list of numbers"),
    "record: bias beyond any float": (None, apply_edited(("0", "heads_bias", [10**400] * 64)), "not a finite number"),
    "record: bias without its kept heads": (None, apply_edited(("0", "heads", None)),
                                            "heads_bias compensates heads that are removed, but the entry has no"),
    "record: a kept head out of range": (None, apply_edited(("0", "heads", [7])), "distinct sorted indices in 0..1"),
    "record: channels unsorted": (None, apply_edited(("3", "channels", [5, 4])), "distinct sorted indices"),
    "record: a layer the model lacks": (None, apply_edited(("0", "heads", [0]), (None, "layers", {"9": {}})),
                                        "layer 9 is out of range"),
    "record: zeroed mask truncated": (None, apply_edited(("1", "zeroed", {"q_proj": MASK[:8]})), "holds 6 bytes"),
    "record: zeroed mask doubled": (None, apply_edited(("1", "zeroed", {"q_proj": MASK_OF_TWO})),
                                    "the mask is truncated or belongs to another projection"),
    "record: zeroed mask not base64": (None, apply_edited(("1", "zeroed", {"q_proj": "@@"})), "not base64"),
    "record: zeroed mask of an unknown projection": (None, apply_edited(("1", "zeroed", {"w_proj": MASK})),
                                                     "unknown projection 'w_proj'"),
    "record: no layers": (None, apply_edited((None, "layers", {})), "layers is empty"),
    "record: params_removed off": (None, apply_edited((None, "params_removed", 19_841)),
                                   "claims params_removed=19841, but its layers remove 19840"),
    "record: weights_zeroed off": (None, apply_edited((None, "weights_zeroed", 3)),
                                   "claims weights_zeroed=3, but its masks zero 0"),
    "record: fingerprint of another model": (None, apply_edited((None, "fingerprint", FINGERPRINT_30)),
                                             "this record was made for another model"),
    "record on a model it already pruned": (lambda m: apply_edited()(m), apply_edited(), "already pruned"),
    # issue 48, 4
    "apply_harp: the mean bypass on every layer": (
        None, lambda m: apply_harp(m, [0, 1, 2, 3], 0.5, bypass="mean"), "would leave none of the model's 4"),
    "apply_harp: the mean bypass on the last layer left": (
        lambda m: apply_harp(m, [0, 1, 2], 0.5, bypass="mean"), lambda m: apply_harp(m, [3], 0.5, bypass="mean"),
        "needs at least one layer that keeps its attention"),
    "search_alphas: the mean bypass on every layer": (
        None, lambda m: search_alphas(m, calib(), [0, 1, 2, 3], bypass="mean"), "would leave none of the model's 4"),
    "a record that removes the last attention a mean bypass left": (
        lambda m: apply_harp(m, [0, 1, 2], 0.5, bypass="mean"), lambda m: ATTN_DROP_TOP.apply(m),
        r"pruning layers \[3\] would leave none of the model's 4"),
    "apply_harp with a float layer": (None, lambda m: apply_harp(m, [2.7]), "layers must be integers"),
    "apply_harp with None": (None, lambda m: apply_harp(m, None), "layers must be a spec"),
    "apply_harp with one int": (None, lambda m: apply_harp(m, 3), "layers must be a spec"),
    "apply_harp with no layers": (None, lambda m: apply_harp(m, []), "no layers given"),
    "apply_harp with a string layer key": (None, lambda m: apply_harp(m, [3], {"3": 0.5}), "not a layer index"),
    "apply_harp with a bool α": (None, lambda m: apply_harp(m, [3], True), "α must be a number"),
    "apply_harp with fold as a string": (None, lambda m: apply_harp(m, [3], 0.5, fold="false"), "fold must be"),
    "apply_harp with meta that is not a dict": (None, lambda m: apply_harp(m, [3], 0.5, meta=[1]), "meta must be"),
    "apply_harp on a pruned layer": (pruned_at_3, lambda m: apply_harp(m, [3], 0.5), "already pruned"),
    "apply_harp with another fold than before": (
        pruned_at_3, lambda m: apply_harp(m, [2], 0.5, fold=False), "pruned with fold=True"),
    "prune with float calibration windows": (
        None, lambda m: prune(m, "flap", 20_000, calib().float(), progress=False), "must be an integer tensor"),
    "prune with ids outside the vocabulary": (
        None, lambda m: prune(m, "flap", 20_000, calib() + 500, progress=False), "vocabulary is 0..127"),
    "search on float windows": (None, lambda m: search_alphas(m, calib().float(), [3]), "must be an integer tensor"),
    "search on negative ids": (None, lambda m: search_alphas(m, calib() - 200, [3]), "vocabulary"),
    "save into the user's folder": (pruned_at_3, lambda m: save_checkpoint(m, USER), "not a checkpoint"),
    "HarpPlan with a bool α": (None, lambda m: HarpPlan(FINGERPRINT, {3: True}), "α must be a number"),
    "HarpPlan with a partial fingerprint": (None, lambda m: HarpPlan({"family": "llama"}, {3: 0.5}),
                                            "fingerprint needs"),
    "PruneRecord of an unknown method": (None, lambda m: PruneRecord.from_dict(RECORD, "rec.json"),
                                         "rec.json: unknown method"),
}


def model_state(model) -> tuple:
    """Structure, config, plan and every weight of a model."""
    plan = getattr(model, "harp_plan", None)
    return (repr(model), json.dumps(model.config.to_dict(), sort_keys=True, default=str),
            plan and plan.to_dict(), {k: v.clone() for k, v in model.state_dict().items()})


@pytest.mark.parametrize("case", list(API))
def test_api_bad_input_is_one_clear_error_and_changes_nothing(case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / USER).mkdir()
    (tmp_path / USER / "notes.txt").write_text("mine")
    setup, call, message = API[case]
    model = make_tiny("llama")
    if setup is not None:
        setup(model)
    files, before = snapshot(tmp_path), model_state(model)
    with pytest.raises(ValueError, match=message):
        call(model)
    after = model_state(model)
    assert after[:3] == before[:3]
    assert after[3].keys() == before[3].keys()
    for key, value in before[3].items():
        torch.testing.assert_close(after[3][key], value, rtol=0, atol=0)
    assert snapshot(tmp_path) == files


@pytest.mark.parametrize("place", ["/", "~", "root", "cwd-parent"])
def test_protected_folders_are_refused_outright(place, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    target = {"/": Path("/"), "~": Path.home(), "root": ROOT, "cwd-parent": tmp_path.parent}[place]
    with pytest.raises(ValueError, match="refusing to save"):
        check_save_target(target, overwrite=True)


# ---------------------------------------------------------------------------------------------- what is accepted
def test_overwrite_replaces_a_checkpoint_as_a_whole(world, capsys):
    old = load_file(world / "ckpt" / "model.safetensors")
    assert main(["prune", "--model", str(world / "tiny"), "--layers", "1", "--alphas", "0",
                 "--save", str(world / "ckpt"), "--overwrite"]) == 0
    loaded, _ = load_model(str(world / "ckpt"))
    assert loaded.harp_plan.alphas == {1: 0.0}
    assert set(load_file(world / "ckpt" / "model.safetensors")) != set(old)
    assert not [p for p in world.iterdir() if p.name.startswith(".ckpt")]  # no temporary folder left behind


def test_an_empty_folder_is_filled_and_files_get_the_usual_modes(world, capsys):
    (world / "empty").mkdir()
    previous = os.umask(0o022)
    try:
        assert main(["prune", "--model", str(world / "tiny"), "--layers", "3", "--save", str(world / "empty")]) == 0
    finally:
        os.umask(previous)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in (world / "empty").iterdir()}
    assert modes and set(modes.values()) == {"0o644"}, modes
    assert oct((world / "empty").stat().st_mode & 0o777) == "0o755"


def test_a_failed_save_leaves_the_target_as_it_was(world, monkeypatch):
    model, tok = load_model(str(world / "ckpt"))
    before = snapshot(world)

    def fail(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(type(model), "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(model, world / "ckpt", overwrite=True)
    assert snapshot(world) == before


def test_harp_with_flap_on_the_mlp_round_trips_through_the_plan_check(world):
    model = make_tiny("llama")
    apply_harp(model, [2, 3], {2: 0.0, 3: 0.7})
    prune(model, "flap", 10_000, calib(), scope="mlp", progress=False)
    save_checkpoint(model, world / "both", AutoTokenizer.from_pretrained(world / "tiny"))
    loaded, _ = load_model(str(world / "both"))
    assert loaded.harp_plan.alphas == {2: 0.0, 3: 0.7} and loaded.prune_record.method == "flap"
    x = calib()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- plain transformers
# issue 48, 2: each case is refused by the checkpoint's own modeling file, where harp_src cannot be imported, with
# one error naming config.json; load_model refuses each too. (source checkpoint, change to config.json, message)
PLAIN = {
    "layer_idx moved": ("mean", lambda c: attention_entry(c, 3).update(layer_idx=2),
                        "model.layers.3.self_attn: its layer_idx is 2, but it is the attention of layer 3"),
    "layer_idx missing": ("mean", lambda c: attention_entry(c, 3).pop("layer_idx"),
                          "model.layers.3.self_attn: a mean bypass without the layer_idx"),
    "mixing missing": ("mean", lambda c: attention_entry(c, 3).pop("mixing"),
                       "its mixing is 'mean' by the plan but 'identity' in the structure"),
    "α in plan and structure, not in the weights": (
        "mean", alpha_everywhere, "model.layers.2.self_attn: its alpha is 0.9 in config.json, but its weights were "
                                  "folded at 0.5"),
    "plan bypasses another layer": ("ckpt", harp_alphas({"1": 0.5, "3": 1.0}),
                                    r"model.layers.1.self_attn: the plan bypasses it \(α 0.5\), the structure keeps"),
    "plan α differs from the structure's": ("ckpt", harp_alphas({"2": 0.9, "3": 1.0}),
                                            "its alpha is 0.9 by the plan but 0.5 in the structure"),
    "structure without a plan": ("ckpt", lambda c: c.pop("harp_plan"), "carries no harp_plan"),
    "record keeps fewer channels than the structure": (
        "flap", fewer_channels, r"layer 1: model.layers.1.mlp.down_proj reads \d+ inputs in the structure, but the "
                                r"record keeps \d+ channels"),
    "record names a layer the structure leaves alone": (
        "flap", lambda c: c["harp_structure"].__setitem__(slice(None), [
            e for e in c["harp_structure"] if not e["path"].startswith("model.layers.1.mlp")]),
        r"layer 1: model.layers.1.mlp.down_proj reads 128 inputs in the structure, but the record keeps \d+ channels"),
    "an entry of an unknown kind": ("ckpt", lambda c: attention_entry(c, 2).update(kind="warp"), "unknown kind 'warp'"),
    "a bypass without its v_proj": ("ckpt", lambda c: attention_entry(c, 2).pop("v_proj"),
                                    "its v_proj is None, which a bypass entry cannot have"),
    "a Linear's shape cut short": ("flap", lambda c: next(e for e in c["harp_structure"] if e["kind"] == "linear")
                                   .update(shape=[64]), r"a Linear's shape is not \[out, in, has bias\]"),
    "an entry naming no module": ("ckpt", lambda c: attention_entry(c, 2).update(path="model.layers.7.self_attn"),
                                  "model.layers.7.self_attn: no module of the dense model"),
}
PLAIN_LOADER = """
import json, sys
sys.modules["harp_src"] = None  # only the checkpoints' own modeling files can serve
from transformers import AutoModelForCausalLM
out = {}
for name, path in json.loads(sys.argv[1]).items():
    try:
        AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
        out[name] = None
    except ValueError as err:
        out[name] = str(err)
print(json.dumps(out))
"""


def test_plain_transformers_refuses_what_load_model_refuses(base_world, tmp_path):
    paths = {}
    for n, (case, (source, change, _)) in enumerate(PLAIN.items()):
        paths[case] = tmp_path / f"case{n}"
        shutil.copytree(base_world / source, paths[case])
        edit_config(paths[case], change)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", PLAIN_LOADER, json.dumps({k: str(v) for k, v in paths.items()})],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    for case, (_, _, message) in PLAIN.items():
        error = errors[case]
        assert error is not None, f"{case}: plain transformers loaded it"
        assert error.startswith(str(paths[case] / "config.json")) and "\n" not in error, error
        assert re.search(message, error), (case, error)
        with pytest.raises(ValueError, match="config.json"):  # and the repository's own loader
            load_model(str(paths[case]))


# ---------------------------------------------------------------------------------------------- the runner
def runner_exit(argv: list[str]) -> int:
    try:
        return runner.main(argv)
    except SystemExit as stop:  # argparse's own usage errors
        return stop.code


PROFILES = {  # malformed profiles, each refused in one line before anything runs
    "a-list": ("- 01_x\n- SEED\n", "must map `common` and notebook names to parameters, not be a list"),
    "common-5": ("common: 5\n", "`common` must map parameter names to values, not be 5"),
    "broken": ("common:\n  SEED: [0\n", "is not valid YAML at line 3"),
    "typo": ("02_typo:\n  SEED: 1\n", "'02_typo' is neither `common` nor a notebook's name"),
}


@pytest.mark.parametrize("argv, message", [
    (["--only"], "argument --only: expected at least one argument"),
    (["--only", "99"], "no notebook matches --only 99"),
    (["--only", "01", "99"], "no notebook matches --only 99"),
    (["--profile", "nope"], r"no profile 'nope': choose one of \['full', 'quick'\]"),
    (["--profile", str(ROOT / "notebooks" / "profiles" / "full.yaml")], "a profile is a name, not a path"),
    (["--profile", "../profiles/full"], "a profile is a name, not a path"),
    *[(["--profile", name], message) for name, (_, message) in PROFILES.items()],
])
def test_runner_refuses_bad_arguments_in_one_line_before_running_anything(argv, message, tmp_path, monkeypatch,
                                                                          capsys):
    notebooks = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks" / "profiles", notebooks / "profiles")
    for name in ["01_x", "02_y"]:
        (notebooks / f"{name}.ipynb").write_text("{}")
    for name, (text, _) in PROFILES.items():
        (notebooks / "profiles" / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(runner, "NOTEBOOKS", notebooks)
    monkeypatch.setattr(runner, "ROOT", tmp_path)
    monkeypatch.setattr(runner, "run_notebook", lambda *a: pytest.fail("a notebook ran"))
    names = sorted(p.stem for p in (notebooks / "profiles").glob("*.yaml"))  # the repository's and these four
    message = message.replace("\\['full', 'quick'\\]", re.escape(str(names)))
    assert runner_exit(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "" and "Traceback" not in captured.err, captured.err
    assert re.search(message, lines[0]), lines[0]
    assert not (tmp_path / ".runs").exists()


# ---------------------------------------------------------------------------------------------- saves (issue 48, 3)
@contextlib.contextmanager
def claimed_elsewhere(target: Path) -> Iterator[None]:
    """A save of `target` in progress in another thread (a claim is re-entrant only within its own thread)."""
    held, done = threading.Event(), threading.Event()

    def hold():
        with save_claim(target, overwrite=True):
            held.set()
            done.wait(60)
    thread = threading.Thread(target=hold)
    thread.start()
    held.wait(60)
    try:
        yield
    finally:
        done.set()
        thread.join()


def test_a_claimed_folder_refuses_a_second_save_and_changes_nothing(world, capsys):
    with claimed_elsewhere(world / "ckpt"):
        before = snapshot(world)
        assert main(["prune", "--model", str(world / "tiny"), "--layers", "1", "--save", str(world / "ckpt"),
                     "--overwrite"]) == 2
        assert snapshot(world) == before
        model = make_tiny("llama")
        apply_harp(model, [1], 0.3)
        with pytest.raises(ValueError, match="is in progress"):
            save_checkpoint(model, world / "ckpt", overwrite=True)
        assert main(["--cleanup", str(world / "ckpt")]) == 2
        assert snapshot(world) == before
    errors = [json.loads(line)["error"] for line in capsys.readouterr().err.splitlines()]
    assert len(errors) == 2 and "in progress" in errors[1]
    error = errors[0]
    assert re.search(r"another save to .*ckpt is in progress; nothing was written", error), error
    assert not (world / ".ckpt.lock").exists()  # released


def test_a_plan_file_can_be_a_pipe(world, capsys):
    read, write = os.pipe()
    os.write(write, (world / "plan.json").read_bytes())
    os.close(write)
    try:
        assert main(["timing", "--model", str(world / "tiny"), "--plan", f"/dev/fd/{read}", "--seq-lens", "8",
                     "--repeats", "1", "--warmup", "1", "--decode-steps", "1"]) == 0
    finally:
        os.close(read)
    assert json.loads(capsys.readouterr().out)["plan"]["alphas"] == {str(k): v for k, v in ALPHAS.items()}


def test_overwrite_without_a_one_step_swap_sets_the_old_checkpoint_aside_and_removes_it(world, monkeypatch):
    monkeypatch.setattr(files, "exchange", lambda a, b: False)  # a system without renameat2's exchange
    model = make_tiny("llama")
    apply_harp(model, [1], 0.3)
    save_checkpoint(model, world / "ckpt", AutoTokenizer.from_pretrained(world / "tiny"), overwrite=True)
    assert load_model(str(world / "ckpt"))[0].harp_plan.alphas == {1: 0.3}
    assert not [p.name for p in world.iterdir() if p.name.startswith(".ckpt")]


CHILD = """
import os, signal, sys, time
from pathlib import Path
import harp_src.checkpoints as checkpoints
import harp_src.report.files as files
from harp_src.__main__ import main
def die():
    os.kill(os.getpid(), signal.SIGKILL)
{patch}
sys.exit(main({argv!r}))
"""
SLOW = """
write = checkpoints.write_partial
def slow(*args):
    write(*args)
    Path({marker!r}).touch()
    time.sleep({seconds})
checkpoints.write_partial = slow
"""
KILLS = {  # where the overwrite is killed: (patch, which checkpoint is at the path after, leftovers)
    "while writing the new one": ("""
def half(model, tokenizer, folder):
    (folder / "config.json").write_text("{{")
    die()
checkpoints.write_partial = half
""", "old"),
    "new one complete, not yet in place": ("""
write = checkpoints.write_partial
checkpoints.write_partial = lambda *args: (write(*args), die())
""", "old"),
    "swapped, the old one not yet removed": ("""
put = checkpoints.put_in_place
checkpoints.put_in_place = lambda *args: (put(*args), die())
""", "new"),
    "halfway through removing the old one": ("""
remove = checkpoints.shutil.rmtree
def half(path, *args, **kwargs):
    if str(path).endswith(".partial"):
        (Path(path) / "model.safetensors").unlink()
        die()
    remove(path, *args, **kwargs)
checkpoints.shutil.rmtree = half
""", "new"),
    "between the two renames, where the system cannot swap": ("""
files.exchange = lambda a, b: False
rename = os.rename
def then_die(src, dst):
    rename(src, dst)
    if ".replaced-" in os.path.basename(dst):
        die()
os.rename = then_die
""", "none until --cleanup puts the old one back"),
}


def child(world: Path, patch: str, argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD.format(patch=patch, argv=argv)], cwd=world / "work",
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def overwrite_argv(world: Path, layer: int = 1) -> list[str]:
    return ["prune", "--model", str(world / "tiny"), "--layers", str(layer), "--alphas", "0.3", "--save",
            str(world / "ckpt"), "--overwrite"]


def saved_alphas(path: Path) -> dict:
    return load_model(str(path))[0].harp_plan.alphas


@pytest.mark.parametrize("step", list(KILLS))
def test_a_kill_at_any_step_of_an_overwrite_leaves_a_complete_checkpoint(step, world, capsys):
    patch, after = KILLS[step]
    proc = child(world, patch, overwrite_argv(world))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    hidden = sorted(p.name for p in world.iterdir() if p.name.startswith(".ckpt"))
    if after == "old":
        assert saved_alphas(world / "ckpt") == ALPHAS
    elif after == "new":
        assert saved_alphas(world / "ckpt") == {1: 0.3}
    else:  # the fallback's one gap: nothing at the path, the old checkpoint set aside beside it
        assert not (world / "ckpt").exists() and any(".replaced-" in name for name in hidden)
    assert any(name.endswith((".partial", ".lock")) or ".replaced-" in name for name in hidden), hidden
    assert main(["--cleanup", str(world / "ckpt")]) == 0
    assert json.loads(capsys.readouterr().out)["cleaned_up"]
    assert not [p.name for p in world.iterdir() if p.name.startswith(".ckpt")]  # leftovers and lock gone
    assert saved_alphas(world / "ckpt") == ({1: 0.3} if after == "new" else ALPHAS)


def test_two_saves_started_together_one_is_refused(world):
    procs = [child(world, SLOW.format(marker=str(world / f"written{layer}"), seconds=8),
                   overwrite_argv(world, layer)) for layer in (1, 2)]
    results = [(*proc.communicate(timeout=300), proc.returncode) for proc in procs]
    assert sorted(code for _, _, code in results) == [0, 2], [r[1][-1000:] for r in results]
    winner = next(layer for layer, (_, _, code) in zip((1, 2), results, strict=True) if code == 0)
    loser_err = next(err for _, err, code in results if code == 2)
    assert re.search(r'"error": "another save to .*ckpt is in progress', loser_err), loser_err
    assert saved_alphas(world / "ckpt") == {winner: 0.3}
    assert not [p.name for p in world.iterdir() if p.name.startswith(".ckpt")]


def test_sigterm_during_a_save_removes_its_temporary_folder(world):
    marker = world / "written"
    proc = child(world, SLOW.format(marker=str(marker), seconds=60), overwrite_argv(world))
    deadline = time.time() + 120
    while not marker.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert marker.exists(), proc.communicate()[1][-2000:]
    assert [p for p in world.iterdir() if p.name.endswith(".partial")]  # the new checkpoint, written aside
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert not [p.name for p in world.iterdir() if p.name.startswith(".ckpt")]  # no .partial, no lock
    assert saved_alphas(world / "ckpt") == ALPHAS  # the old checkpoint, untouched


def test_the_folded_alpha_can_only_be_missing_from_checkpoints_older_than_it(world):
    """A checkpoint of format 2 must carry each bypass's folded α; deleting the tensors does not skip the check. One
    without the format key (saved before folded_alpha existed) loads, its α taken from config.json."""
    weights = world / "mean" / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if not k.endswith("folded_alpha")}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"layers.2.self_attn.folded_alpha is missing \(2 tensors in all\)"):
        load_model(str(world / "mean"))
    edit_config(world / "mean", lambda c: c.pop("harp_format"))
    model, _ = load_model(str(world / "mean"))
    assert model.model.layers[2].self_attn.folded_alpha.item() == 0.5


def test_a_bf16_checkpoint_loads_in_float32(world):
    """The folded α is stored in the weights' dtype: 0.3 in bf16 reads back as 0.30078125, within the check's
    tolerance, while the 0.9-for-0.5 case above is refused."""
    model = make_tiny("llama")
    apply_harp(model, [2, 3], {2: 0.3, 3: 0.7}, bypass="mean")
    save_checkpoint(model.to(torch.bfloat16), world / "bf16", AutoTokenizer.from_pretrained(world / "tiny"))
    loaded, _ = load_model(str(world / "bf16"), dtype="float32")
    assert loaded.model.layers[2].self_attn.folded_alpha.item() == 0.30078125
    assert loaded.harp_plan.alphas == {2: 0.3, 3: 0.7}


def test_an_overwrite_swaps_in_one_step_where_the_system_can(world, monkeypatch):
    swaps = []
    exchange = files.exchange
    monkeypatch.setattr(files, "exchange", lambda a, b: swaps.append(exchange(a, b)) or swaps[-1])
    model = make_tiny("llama")
    apply_harp(model, [1], 0.3)
    save_checkpoint(model, world / "ckpt", AutoTokenizer.from_pretrained(world / "tiny"), overwrite=True)
    assert swaps == [True]  # renameat2's exchange on this file system: no moment without a checkpoint
    assert saved_alphas(world / "ckpt") == {1: 0.3}
    assert not [p.name for p in world.iterdir() if p.name.startswith(".ckpt")]


@pytest.mark.parametrize("harp_first", [True, False])
def test_harp_and_a_baseline_in_either_order_load(world, harp_first):
    """A model pruned by both, in either order (HARP, then FLAP on the MLPs; unstructured Wanda, then HARP), loads
    through load_model, which tries both orders, as through the checkpoint's own modeling file."""
    model = make_tiny("llama")
    if harp_first:
        apply_harp(model, [3], 0.6)
        prune(model, "flap", 5_000, calib(), scope="mlp", progress=False)
    else:
        prune(model, "wanda", 2_000, calib(), progress=False)
        apply_harp(model, [3], 0.6)
    save_checkpoint(model, world / "both", AutoTokenizer.from_pretrained(world / "tiny"))
    loaded, _ = load_model(str(world / "both"))
    x = calib()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=0, atol=0)
