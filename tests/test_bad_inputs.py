"""Bad input as a new user gives it (issue 25): each case gets one clear error (one line and exit 2 from the CLI, one
ValueError from the API), and nothing changes: not the user's files, not the current directory, not the model.

Every CLI case runs in a fresh copy of a small world: a tiny Llama as a model folder, a HARP checkpoint of it, a
plan file, a folder of the user's and a working directory with a file in it. The table rows are the cases of the
issue, one each; the tests after it show that the accepted inputs still work (overwrite, empty folder, file modes).
"""

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from conftest import make_tiny
from harp_src import HarpPlan, apply_harp, load_model, prune, save_checkpoint, search_alphas
from harp_src.__main__ import main
from harp_src.checkpoints import check_save_target
from harp_src.model.loading import resolve_source
from harp_src.pruning.record import PruneRecord
from harp_src.report.files import ROOT

ALPHAS = {2: 0.5, 3: 1.0}


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


def truncate(path: Path, size: int) -> None:
    path.write_bytes(path.read_bytes()[:size])


def plan_case(edit=None, text=None):
    return lambda w: ["ppl", "--model", str(w / "tiny"), "--plan", write_plan(w, edit, text)]


def ckpt_case(change):
    def build(w):
        change(w)
        return ["ppl", "--model", str(w / "ckpt")]
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
        "disagree at model.layers.1.mlp"),
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
USER = Path("user-folder")  # in the test's working directory, holding the user's notes.txt

# case: (what the model went through before, the bad call, the message)
API = {
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
