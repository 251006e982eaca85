"""The command line prints JSON and refuses bad input with one message."""

import json

import pytest

from harp_src.__main__ import main, parse_alphas


def test_parse_alphas():
    assert parse_alphas("0.5") == 0.5
    assert parse_alphas("22=0.5,23=0.25") == {22: 0.5, 23: 0.25}


@pytest.mark.slow
def test_prune_and_ppl_round_trip(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["prune", "--model", "smollm2-135m", "--layers", "top:8", "--alphas", "1.0", "--out", str(plan),
                 "--ppl", "--n-windows", "1", "--seq-len", "64"]) == 0
    pruned = json.loads(capsys.readouterr().out)
    assert pruned["params_before"] - pruned["params_after"] == pruned["params_removed"] > 0
    assert pruned["ratio_paper"] == pytest.approx(8 / 240)
    assert main(["ppl", "--plan", str(plan), "--n-windows", "1", "--seq-len", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] == pytest.approx(pruned["ppl_after"], rel=1e-6)


@pytest.mark.slow
def test_search_benchmark_prints_both_times_interleaved(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["search", "--model", "smollm2-135m", "--layers", "top:2", "--grid", "0,1", "--compare-naive",
                 "--threads", "1", "--n-windows", "1", "--seq-len", "32", "--out", str(plan)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["same_alphas"] is True and out["threads"] == 1 and out["candidates"] == 4
    assert out["measured_ratio"] == pytest.approx(out["naive_s"] / out["cached_s"]) and out["flop_ratio"] > 1
    assert json.loads(plan.read_text())["alphas"] == {str(k): v for k, v in out["alphas"].items()}


def test_bad_input_gives_one_error(capsys):
    assert main(["prune", "--model", "not-a-model", "--layers", "top:2"]) == 2
    assert "packaged names" in json.loads(capsys.readouterr().err)["error"]
