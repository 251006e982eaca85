"""Timing harness and FLOP bound: columns, exact KV bytes, decode FLOPs by hand, bad input."""

import json

import pytest
import torch
from transformers import LlamaConfig

from conftest import make_tiny
from harp_src.__main__ import main
from harp_src.measure.flops import layer_flops, model_flops, speedup_bound
from harp_src.measure.timing import compare, flop_bounds, harp_copy, kv_bytes_formula
from harp_src.method.harp import HarpPlan
from harp_src.model.paper import OFFICIAL_LLAMA31_8B_TOP_FIRST

COLUMNS = {"median_dense_s", "median_harp_s", "speedup", "flop_bound", "kv_bytes_dense", "kv_bytes_harp",
           "device", "seq_len", "decode_dense_ms", "decode_harp_ms", "peak_mem_dense", "peak_mem_harp"}
LLAMA31_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=14336, vocab_size=128256)


def test_decode_flops_by_hand():
    cfg = LlamaConfig(hidden_size=8, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=16, vocab_size=10)  # head_dim 4
    # one new token over 5 cached ones sees 6 keys: scores + weighted sum 2·(2 heads·4) MACs per key
    assert layer_flops(cfg, 1, past=5) == 2 * ((64 + 32 + 32 + 64 + 384) + 2 * 2 * 4 * 6)
    assert layer_flops(cfg, 1, 1.0, past=5) == layer_flops(cfg, 1, 1.0)  # no attention, no dependence on context
    # prefill of 3 tokens after 5 cached: pairs 3·5 + 6
    assert layer_flops(cfg, 3, past=5) - layer_flops(cfg, 3) == 2 * 2 * 2 * 4 * 15
    assert model_flops(cfg, 1, past=5, head_tokens=1) == 2 * layer_flops(cfg, 1, past=5) + 2 * 8 * 10


def test_bound_grows_with_n_and_length():
    cfg = LlamaConfig(**LLAMA31_8B)
    assert speedup_bound(cfg, 4096, {}, head_tokens=1) == 1.0
    pruned = [model_flops(cfg, 4096, {31 - i: 1.0 for i in range(n)}, head_tokens=1) for n in range(9)]
    assert pruned == sorted(set(pruned), reverse=True)  # strictly fewer FLOPs with every extra pruned layer
    table = flop_bounds(cfg, {i: 1.0 for i in range(24, 32)}, [1024, 8192, 65536])
    assert table.flop_bound.is_monotonic_increasing and table.decode_flop_bound.is_monotonic_increasing


def test_llama31_8b_official_plan_bound_at_64k():
    """The paper's setting: the official top-8 α's at 65,536 tokens (the paper measures +16.7 %)."""
    cfg = LlamaConfig(**LLAMA31_8B)
    alphas = {31 - i: a for i, a in enumerate(OFFICIAL_LLAMA31_8B_TOP_FIRST)}
    bound = speedup_bound(cfg, 65536, alphas, head_tokens=1)
    assert 1.15 < bound < 1.25
    assert bound > speedup_bound(cfg, 65536, {i: 1.0 for i in alphas}, head_tokens=1)  # α = 0 layers lose V, O too


@pytest.mark.parametrize("fam", ["llama", "qwen2", "gemma3"])
def test_harness_columns_and_exact_kv_bytes(fam):
    dense = make_tiny(fam)
    harp, plan = harp_copy(dense, "top:2")
    assert not hasattr(dense, "harp_plan")
    summary, samples = compare(dense, harp, [16, 48], repeats=2, decode_steps=3, threads=1, progress=False)
    assert COLUMNS <= set(summary.columns) and list(summary.seq_len) == [16, 48]
    assert len(samples) == 2 * 2 * (2 + 3)  # 2 lengths × 2 models × (2 prefills + 3 decode steps)
    row = summary.iloc[1]
    assert row.speedup == pytest.approx(row.median_dense_s / row.median_harp_s)
    if fam != "gemma3":  # every layer global: K, V bytes = dense · (L − N) / L, exactly
        assert row.kv_bytes_dense == kv_bytes_formula(dense.config, 48)
        assert row.kv_bytes_harp == kv_bytes_formula(dense.config, 48, n_pruned=2)
        assert row.kv_bytes_harp * 4 == row.kv_bytes_dense * 2
    else:  # sliding-window layers (window 8) keep 8 positions, so (L − N)/L does not hold; dense minus pruned does
        assert 0 < row.kv_bytes_harp < row.kv_bytes_dense
    assert row.kv_bytes_harp == row.kv_bytes_expected
    assert row.flop_bound == pytest.approx(speedup_bound(dense.config, 48, plan.alphas, head_tokens=1))
    assert (summary.threads == 1).all()
    assert torch.get_num_threads() >= 1


def test_harness_refuses_bad_input():
    dense = make_tiny("llama")
    harp, _ = harp_copy(dense, [3])
    with pytest.raises(ValueError, match="not pruned"):
        compare(dense, make_tiny("llama"), [16], progress=False)
    with pytest.raises(ValueError, match="dense one"):
        compare(harp, harp, [16], progress=False)
    with pytest.raises(ValueError, match="seq_lens"):
        compare(dense, harp, [], progress=False)
    with pytest.raises(ValueError, match="repeats"):
        compare(dense, harp, [16], repeats=0, progress=False)


@pytest.mark.slow
def test_cli_timing_rows(tmp_path, capsys):
    csv = tmp_path / "rows.csv"
    assert main(["timing", "--model", "smollm2-135m", "--layers", "top:8", "--seq-lens", "32,64", "--repeats", "1",
                 "--decode-steps", "1", "--threads", "1", "--csv", str(csv)]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert [r["seq_len"] for r in rows] == [32, 64]
    assert all(r["kv_bytes_harp"] * 30 == r["kv_bytes_dense"] * 22 for r in rows)
    assert csv.read_text().splitlines()[0].count(",") >= 5
    assert HarpPlan.from_dict(out["plan"]).alphas == {i: 1.0 for i in range(22, 30)}


def test_cli_timing_bad_lengths(capsys):
    assert main(["timing", "--model", "smollm2-135m", "--layers", "top:8", "--seq-lens", "0,64"]) == 2
    assert "seq_lens" in json.loads(capsys.readouterr().err)["error"]
