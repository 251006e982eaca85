"""Pruned models as checkpoints: save_pretrained → from_pretrained (with and without harp_src), smaller on disk,
accelerate offload, lm-eval's CLI, and checkpoints that do not match their plan."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from conftest import make_tiny
from harp_src import apply_harp, load_model
from harp_src.__main__ import main
from harp_src.checkpoints import save_checkpoint, tensor_bytes, weights_bytes
from harp_src.method.harp import harp_applied
from harp_src.model.loading import resolve_source
from harp_src.model.modeling_harp import STRUCTURE, mark_pruned
from harp_src.pruning.prune import prune

ALPHAS = {1: 0.0, 2: 0.4, 3: 1.0}  # a dropped layer, a rescaled one, a plain bypass
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_source("smollm2-135m")[0])


def ids(n=2, t=12, seed=0):
    return torch.randint(3, 120, (n, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def logits(model, x):
    return model(x).logits


@torch.no_grad()
def greedy(model, x, steps=6):
    return model.generate(x, max_new_tokens=steps, do_sample=False, use_cache=True, pad_token_id=0)


def same_model(a, b, x):
    assert_close(logits(b, x), logits(a, x), rtol=0, atol=0)
    assert torch.equal(greedy(b, x[:1]), greedy(a, x[:1]))


@pytest.mark.parametrize("fold", [True, False])
def test_round_trip_every_family(family, fold, tokenizer, tmp_path):
    model = make_tiny(family)
    apply_harp(model, list(ALPHAS), ALPHAS, fold=fold)
    info = save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    assert info["pruned"] and (tmp_path / "ckpt" / "modeling_harp.py").exists()
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["harp_plan"]["harp"]["alphas"] == {"1": 0.0, "2": 0.4, "3": 1.0}
    assert config["auto_map"]["AutoModelForCausalLM"].startswith("modeling_harp.Harp")
    stored = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert not any(f"layers.{i}.self_attn.{p}_proj" in k for i in ALPHAS for p in "qk" for k in stored)
    assert not any(f"layers.1.self_attn.{p}_proj" in k for p in "vo" for k in stored)  # α = 0: V and O gone too
    loaded, tok = load_model(str(tmp_path / "ckpt"))
    assert loaded.harp_plan.alphas == ALPHAS and tok.get_vocab() == tokenizer.get_vocab()
    remote = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)
    for other in (loaded, remote):
        same_model(model, other, ids())


def test_dense_model_saves_as_an_ordinary_checkpoint_with_a_warning(family, tmp_path):
    model = make_tiny(family)
    with pytest.warns(UserWarning, match="ordinary dense checkpoint"):
        info = save_checkpoint(model, tmp_path / "dense")
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    assert not info["pruned"] and "auto_map" not in config and STRUCTURE not in config
    same_model(model, AutoModelForCausalLM.from_pretrained(tmp_path / "dense"), ids())


@pytest.mark.parametrize("method", ["mag-sp", "attn-drop-top", "flap", "wanda"])
def test_baseline_pruned_models_round_trip(method, tokenizer, tmp_path):
    """Sliced heads and MLP channels (Mag-sp), whole attention sub-layers turned constant (attention drop), new
    compensation biases (FLAP) and zeroed weights in dense shapes (unstructured Wanda)."""
    for family in ("llama", "gemma3"):
        model = make_tiny(family)
        record = prune(model, method, 20_000, ids(4, 16, seed=1), progress=False)
        save_checkpoint(model, tmp_path / family, tokenizer)
        loaded, _ = load_model(str(tmp_path / family))
        assert loaded.prune_record.to_dict() == record.to_dict()
        same_model(model, loaded, ids())
        loaded.save_pretrained(tmp_path / f"{family}-again")  # saving what was loaded keeps the record
        again = json.loads((tmp_path / f"{family}-again" / "config.json").read_text())
        assert again["harp_plan"]["baseline"] == record.to_dict()
        assert again["architectures"][0].startswith("Harp") == (method != "wanda")  # Wanda keeps every shape
        same_model(model, AutoModelForCausalLM.from_pretrained(tmp_path / family, trust_remote_code=True), ids())


def test_a_fresh_process_restores_a_baseline_record(tokenizer, tmp_path):
    model = make_tiny("qwen2")
    prune(model, "flap", 20_000, ids(4, 16, seed=1), progress=False)
    save_checkpoint(model, tmp_path / "flap", tokenizer)
    script = f"from harp_src import load_model\nprint(load_model({str(tmp_path / 'flap')!r})[0].prune_record.method)"
    fresh = subprocess.run([sys.executable, "-c", script], check=True, capture_output=True, text=True, timeout=300)
    assert fresh.stdout.split()[-1] == "flap"


@pytest.mark.slow
def test_smollm2_checkpoint_is_smaller_by_the_deleted_tensors_and_loads_without_harp_src(tmp_path):
    dense, tok = load_model("smollm2-135m")
    model, _ = load_model("smollm2-135m")
    alphas = {22: 0.0, **{i: 0.3 for i in range(23, 30)}}
    apply_harp(model, list(alphas), alphas)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_checkpoint(dense, tmp_path / "dense")
    model.save_pretrained(tmp_path / "harp")  # the API itself: load_model attached the tokenizer, so it is saved too
    assert (tmp_path / "harp" / "tokenizer.json").exists()
    deleted = tensor_bytes(dense) - tensor_bytes(model)
    assert deleted > 20e6  # q, k of 8 layers, v, o of one, the folded o_proj's repeated columns
    drop = weights_bytes(tmp_path / "dense") - weights_bytes(tmp_path / "harp")
    assert abs(drop - deleted) < 64 * 1024  # only the safetensors headers differ
    x = ids(2, 24)
    torch.save(x, tmp_path / "ids.pt")
    expected = logits(model, x), model.generate(x[:1], max_new_tokens=8, do_sample=False, use_cache=True)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    for how, load in LOADERS.items():  # each in a fresh process
        script = FRESH_PROCESS.format(load=load.format(ckpt=str(tmp_path / "harp")), ids=str(tmp_path / "ids.pt"),
                                      out=str(tmp_path / f"{how}.pt"))
        subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=300)
        out = torch.load(tmp_path / f"{how}.pt")
        assert_close(out["logits"], expected[0], rtol=0, atol=0)
        assert torch.equal(out["greedy"], expected[1]), how
    assert list((tmp_path / "modules").rglob("modeling_harp.py"))  # the checkpoint's own copy was used


LOADERS = {
    "harp_src": "from harp_src import load_model\nmodel, _ = load_model({ckpt!r})",
    # harp_src is installed (editable) here: block it, so only the checkpoint's own modeling file can serve
    "transformers only": ("import sys\nsys.modules['harp_src'] = None\ntry:\n    import harp_src  # noqa: F401\n"
                          "    raise SystemExit('harp_src is importable')\nexcept ImportError:\n    pass\n"
                          "from transformers import AutoModelForCausalLM\n"
                          "model = AutoModelForCausalLM.from_pretrained({ckpt!r}, trust_remote_code=True)"),
}
FRESH_PROCESS = """
import torch
{load}
x = torch.load({ids!r})
with torch.no_grad():
    out = {{"logits": model(x).logits,
           "greedy": model.generate(x[:1], max_new_tokens=8, do_sample=False, use_cache=True)}}
torch.save(out, {out!r})
"""


@pytest.mark.parametrize("how", ["harp", "flap", "attn-drop-top"])
def test_harp_and_baseline_checkpoints_load_in_a_fresh_process_with_plain_transformers(how, tokenizer, tmp_path):
    """Nothing is registered by importing a module: a HARP and a baseline checkpoint both load where harp_src
    cannot even be imported, through the checkpoint's own modeling file, and give the same logits and greedy text."""
    model = make_tiny("qwen2")
    if how == "harp":
        apply_harp(model, [1, 3], {1: 0.0, 3: 0.6})
    else:
        prune(model, how, 20_000, ids(4, 16, seed=1), progress=False)
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    x = ids(2, 12)
    torch.save(x, tmp_path / "ids.pt")
    expected = logits(model, x), model.generate(x[:1], max_new_tokens=8, do_sample=False, use_cache=True)
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    script = FRESH_PROCESS.format(load=LOADERS["transformers only"].format(ckpt=str(tmp_path / "ckpt")),
                                  ids=str(tmp_path / "ids.pt"), out=str(tmp_path / "out.pt"))
    subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=tmp_path, timeout=300)
    out = torch.load(tmp_path / "out.pt")
    assert_close(out["logits"], expected[0], rtol=0, atol=0)
    assert torch.equal(out["greedy"], expected[1])
    assert list((tmp_path / "modules").rglob("modeling_harp.py"))  # the checkpoint's own copy served


def test_accelerate_offload_gives_the_same_logits(tokenizer, tmp_path):
    model = make_tiny("llama")
    apply_harp(model, [2, 3], {2: 0.5, 3: 0.0})
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True,
                                                     device_map=device_map, offload_folder=tmp_path / "offload")
    # layers 1 and 2 stay on disk (read from the safetensors file when they run): meta tensors until then
    assert "disk" in offloaded.hf_device_map.values()
    assert {n.split(".")[2] for n, p in offloaded.named_parameters() if p.device.type == "meta"} == {"1", "2"}
    same_model(model, offloaded, ids())


@pytest.mark.slow
def test_lm_eval_cli_runs_a_pruned_checkpoint(tmp_path):
    model, tok = load_model("smollm2-135m")
    apply_harp(model, "top:4", 0.5)
    save_checkpoint(model, tmp_path / "ckpt", tok)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    cmd = [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
           f"pretrained={tmp_path / 'ckpt'},trust_remote_code=True", "--tasks", "arc_easy", "--limit", "3",
           "--include_path", str(ROOT / "harp_src" / "data" / "lm_tasks"), "--output_path", str(tmp_path / "out")]
    subprocess.run(cmd, check=True, env=env, cwd=tmp_path, timeout=600)
    result = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert 0.0 <= result["results"]["arc_easy"]["acc,none"] <= 1.0
    assert result["config"]["model_args"]["trust_remote_code"] in (True, "True")


def test_checkpoint_whose_weights_do_not_match_its_plan_is_refused(tokenizer, tmp_path):
    model = make_tiny("llama")
    apply_harp(model, [2, 3], {2: 0.5, 3: 1.0})
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    path = tmp_path / "ckpt" / "model.safetensors"
    weights = load_file(path)
    missing = dict(weights)
    del missing["model.layers.3.self_attn.v_proj.weight"]
    save_file(missing, path, metadata={"format": "pt"})
    for load in (lambda: load_model(str(tmp_path / "ckpt")),
                 lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)):
        with pytest.raises(ValueError, match=r"model\.layers\.3\.self_attn\.v_proj\.weight is missing"):
            load()
    wrong = dict(weights)
    wrong["model.layers.2.self_attn.o_proj.weight"] = torch.zeros(64, 48)
    extra = dict(weights)
    extra["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(64, 64)  # a dense tensor the plan deleted
    for bad, message in ((wrong, "o_proj.weight has the wrong shape"), (extra, "q_proj.weight is not part of")):
        save_file(bad, path, metadata={"format": "pt"})
        for load in (lambda: load_model(str(tmp_path / "ckpt")),
                     lambda: AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", trust_remote_code=True)):
            with pytest.raises(ValueError, match=message):
                load()


def test_unsupported_family_or_class_is_refused(tokenizer, tmp_path):
    model = make_tiny("llama")
    apply_harp(model, [3], 0.5)
    save_checkpoint(model, tmp_path / "ckpt", tokenizer)
    config_path = tmp_path / "ckpt" / "config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "modeling_harp.HarpFalconForCausalLM"
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="supported are"):
        load_model(str(tmp_path / "ckpt"))
    assert not mark_pruned(torch.nn.Linear(2, 2))  # no checkpoint class: nothing changes


def test_search_contexts_leave_the_model_an_ordinary_one(tmp_path):
    model = make_tiny("llama")
    with harp_applied(model, [3], {3: 0.5}):
        assert type(model).__name__ == "HarpLlamaForCausalLM"
    assert type(model) is LlamaForCausalLM
    mark_pruned(model)  # a checkpoint class with nothing pruned in it still saves a plain dense checkpoint
    with pytest.warns(UserWarning, match="no pruned module"):
        model.save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "auto_map" not in config
    assert "harp_structure" not in model.config.to_dict()  # saving leaves the model's own config alone


@pytest.mark.slow
def test_cli_prune_and_search_save_checkpoints(tmp_path, capsys):
    assert main(["prune", "--model", "smollm2-135m", "--layers", "top:2", "--alphas", "0.5",
                 "--save", str(tmp_path / "pruned")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["checkpoint"]["pruned"] and out["checkpoint"]["weights_bytes"] == weights_bytes(tmp_path / "pruned")
    assert main(["search", "--model", "smollm2-135m", "--layers", "top:1", "--grid", "0,0.5,1", "--n-windows", "1",
                 "--seq-len", "32", "--save", str(tmp_path / "searched")]) == 0
    out = json.loads(capsys.readouterr().out)
    loaded, _ = load_model(str(tmp_path / "searched"))
    assert loaded.harp_plan.alphas == {29: out["alphas"]["29"]}
