"""The graph of steps (`harp_src.steps`): ids and the store, the inline and Ray executors (retries, a killed worker,
reruns), `--plan`'s critical path and list scheduling, the runner's refusals, every study's steps as data a worker
rebuilds, and 06, 09 and 10 on Ray writing what inline writes."""

import os
import pickle
import sys
from pathlib import Path

import pandas as pd
import pytest

from harp_src import runner
from harp_src.steps import executors, plan
from harp_src.steps import graph as graph_mod
from harp_src.steps.graph import Graph, Step
from harp_src.studies import graphs

TOY = "steps_toy"


@pytest.fixture
def store(tmp_path, monkeypatch):
    """Steps stored under tmp_path, the toy functions importable in Ray workers."""
    monkeypatch.setattr(graph_mod, "PARTS", tmp_path / "parts")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), *sys.path]))
    monkeypatch.delenv(graph_mod.RUN_ENV, raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray cluster of 2 CPUs for this module's Ray tests (a start and its workers' imports cost ~20 s on 2
    loaded cores); the executor uses a session its caller opened and leaves it open. Its workers import the toy steps
    and see no run id."""
    with pytest.MonkeyPatch.context() as mp:  # only for the start: the workers take their environment from it
        mp.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), *sys.path]))
        mp.delenv(graph_mod.RUN_ENV, raising=False)
        ray = executors.start_ray(workers=2, threads=1)
    yield ray
    ray.shutdown()


def toy(fn: str = "number", **key) -> tuple[str, dict]:
    return f"{TOY}:{fn}", key


def diamond(g: Graph, fn: str = "number", **extra) -> list[str]:
    """a → b, a → c, (b, c) → d: d = a + b + c + ... with values 1, 10, 100, 1000."""
    a = g.add(Step("nb", *toy(value=1), label="a"))
    b = g.add(Step("nb", *toy(fn, value=10, **extra), needs={"x": a}, label="b"))
    c = g.add(Step("nb", *toy(value=100), needs={"x": a}, label="c"))
    d = g.add(Step("nb", *toy(value=1000), needs={"b": b, "c": c}, label="d"))
    return [a, b, c, d]


def test_step_ids_are_what_the_step_depends_on(store):
    a, b = Step("nb", "m:f", {"k": (1, 2)}), Step("other", "m:f", {"k": [1, 2]})
    assert a.id == b.id  # the same work wherever it is declared; its key compared as JSON gives it back
    assert Step("nb", "m:f", {"k": [1, 3]}).id != a.id and Step("nb", "m:g", {"k": [1, 2]}).id != a.id
    g = Graph()
    with pytest.raises(ValueError, match="not declared before it"):
        g.add(Step("nb", "m:f", {}, needs={"x": "nope"}))
    assert g.add(a) == g.add(b) and len(g) == 1


def test_inline_runs_in_order_stores_and_reuses_only_when_asked(store):
    g = Graph()
    ids = diamond(g)
    out = executors.run_steps(g, reuse=False)
    assert [out.results[i] for i in ids] == [1, 11, 101, 1112] and len(out.computed) == 4
    assert all(out.provenance[i]["host"] and out.provenance[i]["commit"] for i in ids)
    assert len(executors.run_steps(g, reuse=True).reused) == 4
    assert len(executors.run_steps(g, reuse=False).computed) == 4  # REUSE_PARTS off: nothing from an earlier run


def test_a_stored_step_whose_key_disagrees_is_computed_again(store):
    g = Graph()
    ids = diamond(g)
    executors.run_steps(g, reuse=False)
    path = g.steps[ids[3]].path
    kept = pickle.loads(path.read_bytes())
    kept["params"]["key"]["value"] = 5  # as if stored by code whose key said something else
    kept["part"] = -1
    path.write_bytes(pickle.dumps(kept))
    out = executors.run_steps(g, reuse=True)
    assert out.computed == [ids[3]] and out.results[ids[3]] == 1112


def test_a_runs_own_steps_are_reused_without_reuse_parts(store, monkeypatch):
    g = Graph()
    diamond(g)
    monkeypatch.setenv(graph_mod.RUN_ENV, "run-1")
    executors.run_steps(g, reuse=False)
    assert len(executors.run_steps(g, reuse=False).reused) == 4  # the notebooks after the runner's steps
    monkeypatch.setenv(graph_mod.RUN_ENV, "run-2")
    assert len(executors.run_steps(g, reuse=False).computed) == 4


def test_unknown_executor_is_refused(store):
    with pytest.raises(ValueError, match="unknown executor 'slurm'"):
        executors.run_steps(Graph(), reuse=False, executor="slurm")


@pytest.mark.slow
def test_ray_retries_a_killed_worker_reports_a_failure_and_a_rerun_computes_only_what_is_missing(store, local_ray):
    """On a local Ray cluster of 2 workers: the diamond gives inline's results; a step whose worker is killed once
    is retried and finishes; a step killed on every try and one that raises are reported while every step that does
    not need them is stored; the rerun computes only the missing steps, with inline's results."""
    (store / "m1").mkdir()
    (store / "m2").mkdir()
    g = Graph()
    ids = diamond(g)
    once = g.add(Step("nb", *toy("flaky", value=7, marker=str(store / "m1"), kills=1), needs={"x": ids[0]}))
    always = g.add(Step("nb", *toy("flaky", value=9, marker=str(store / "m2"), kills=2), needs={"x": ids[0]}))
    after = g.add(Step("nb", *toy(value=5), needs={"x": always}))
    bad = g.add(Step("nb", *toy("broken", value=3)))
    out = executors.run_steps(g, reuse=False, executor="ray", workers=2)
    assert local_ray.is_initialized()  # the caller's session stays open
    assert [out.results[i] for i in ids] == [1, 11, 101, 1112] and out.results[once] == 8
    assert set(out.failed) == {always, after, bad}
    assert len(list((store / "m1").glob("try-*"))) == 2 and len(list((store / "m2").glob("try-*"))) == 2
    assert "always fails" in out.failed[bad]
    (store / "m2" / "try-2").touch()  # the next try is the third: it survives
    g2 = Graph()
    for step in g:
        g2.add(step if step.id != bad else Step("nb", *toy(value=3)))
    rerun = executors.run_steps(g2, reuse=True, executor="ray", workers=2)
    assert sorted(rerun.computed) == sorted([always, after, Step("nb", *toy(value=3)).id])
    assert rerun.results[always] == 10 and rerun.results[after] == 15


@pytest.mark.parametrize("opened", [False, True], ids=["no session", "the caller's session"])
def test_ray_executor_closes_only_the_cluster_it_started(opened, store, monkeypatch):
    """Without a session, run_ray starts a local cluster and shuts it down after the graph; in a session its caller
    opened, it starts nothing and leaves it open (a stand-in for ray records the calls)."""
    import types

    calls = []
    fake = types.SimpleNamespace(
        is_initialized=lambda: opened, init=lambda **kw: calls.append("init"),
        shutdown=lambda: calls.append("shutdown"), remote=lambda fn: fn,
        nodes=lambda: [{"Alive": True, "Resources": {"CPU": 2}}])
    monkeypatch.setitem(sys.modules, "ray", fake)
    out = executors.run_steps(Graph(), reuse=False, executor="ray", workers=2)
    assert out.computed == [] and calls == ([] if opened else ["init", "shutdown"])


def test_plan_critical_path_and_list_scheduling():
    """a(10) → b(5), a → c(7), (b, c) → d(1): the critical path a, c, d is 18 s; one worker takes the sum, 23 s;
    two take the critical path; a third changes nothing."""
    g = Graph()
    ids = diamond(g)
    seconds = dict(zip(ids, [10.0, 5.0, 7.0, 1.0], strict=True))
    costed = [plan.Costed(s, seconds[s.id], "stored") for s in g]
    length, chain = plan.critical_path(costed)
    assert length == 18.0 and [c.step.label for c in chain] == ["a", "c", "d"]
    assert [plan.list_schedule(costed, k) for k in (1, 2, 3)] == [23.0, 18.0, 18.0]
    with pytest.raises(ValueError, match="at least 1"):
        plan.list_schedule(costed, 0)


def test_plan_counts_stored_seconds_and_estimates_the_rest(store):
    g = Graph()
    ids = diamond(g)
    executors.run_steps(g, reuse=False)
    extra = g.add(Step("nb", *toy(value=2), size=4.0, label="new"))
    costed = {c.step.id: c for c in plan.cost(g, recorded=False)}
    assert {costed[i].source for i in ids} == {"stored"} and costed[extra].source == "size"
    rate = plan.stored_rates(graph_mod.PARTS)[f"{TOY}:number"]
    assert costed[extra].seconds == pytest.approx(4.0 * rate)


def test_plan_scales_estimates_to_the_last_full_run(store):
    """With nothing stored, each model's 06 steps add up to its recorded full-run seconds, its timing steps to the
    recorded timing part; 03 (no per-model record) adds up to its wall time; other profiles are not scaled."""
    g, _, _ = runner.study_graphs("full", runner.select(["03", "06"]))
    costed = plan.cost(g)
    totals, timing = plan.recorded_seconds("06_baselines"), plan.recorded_timing("06_baselines")
    assert timing.keys() == totals.keys() == {"smollm2-135m", "gemma3-270m"}
    for model, total in totals.items():
        mine = [c for c in costed if c.step.notebook == "06_baselines" and c.step.key["setup"]["model"] == model]
        assert sum(c.seconds for c in mine) == pytest.approx(total)
        assert sum(c.seconds for c in mine if c.step.alone) == pytest.approx(timing[model])
    alpha = [c for c in costed if c.step.notebook == "03_alpha_search"]
    assert plan.recorded_seconds("03_alpha_search") == {}
    assert sum(c.seconds for c in alpha) == pytest.approx(plan.notebook_seconds()["03_alpha_search"])
    assert {c.source for c in plan.cost(g, recorded=False)} == {"size"}


@pytest.mark.parametrize("argv, message", [
    (["--workers", "0"], "--workers must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"),
    (["--executor", "slurm"], "invalid choice: 'slurm'"),
    (["--ray-address", "127.0.0.1:9"], "no Ray cluster answers at --ray-address 127.0.0.1:9"),
    (["--ray-address", "nonsense"], "is not HOST:PORT"),
    (["--workers", "2", "--ray-address", "127.0.0.1:9"], "not both"),
    (["--executor", "inline", "--workers", "2"], "drop --executor inline"),
    (["--profile", "quick-cuda", "--only", "06"], "this machine has no CUDA GPU"),
])
def test_runner_refuses_bad_executor_arguments_in_one_line(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(runner, "run_notebook", lambda *a: pytest.fail("a notebook ran"))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    try:
        code = runner.main(["--only", "06", *argv])
    except SystemExit as stop:  # argparse's own refusals (an unknown --executor) exit the same way
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_plan_of_the_full_and_paper_profiles_runs_nothing(store, capsys, monkeypatch):
    monkeypatch.setattr(runner, "run_notebook", lambda *a: pytest.fail("a notebook ran"))
    monkeypatch.setattr(runner, "run_steps", lambda *a, **k: pytest.fail("a step ran"))
    assert runner.main(["--plan", "--profile", "paper", "--only", "06", "10"]) == 0
    text = capsys.readouterr().out
    # which model ends the critical path depends on the seconds the store holds; that it is a paper model does not
    paper_models = set(runner.profile_parameters("paper", "06_baselines")["MODELS"])
    path = text.split("critical path:")[1].split("predicted wall time")[0]
    assert any(m in path for m in paper_models), path
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 3]
    assert [int(r[0]) for r in rows] == list(runner.PLAN_WORKERS)
    hours = [float(r[1]) for r in rows]
    assert hours == sorted(hours, reverse=True) and hours[0] > hours[-1] > 0


SPEED = ("speedup_2k", "speedup_8k", "decode_speedup_8k", "decode_tokens_per_s_8k", "seconds", "items_per_s")  # timed


def _csvs(study: dict) -> dict:
    """A study's tables as the CSV text the figures are written in, without what comes from a timing."""
    return {k: v.drop(columns=[c for c in SPEED if c in v.columns]).to_csv(index=False, float_format="%.6g")
            for k, v in study.items() if isinstance(v, pd.DataFrame) and k not in ("seconds", "mean_speed")}


@pytest.mark.parametrize("notebook", sorted(graphs()))
def test_every_declared_step_is_data_a_worker_rebuilds(notebook):
    """What a Ray worker gets of a step is the step itself: every step of each study's default graph pickles back to
    an equal step with the same id, its key is plain JSON, and its function is a module-level one imported by name
    (no closure over what the driver holds)."""
    params, declare = graphs()[notebook]
    g = declare(params.defaults())[0]
    assert len(g) > 0
    for step in g:
        again = pickle.loads(pickle.dumps(step))
        assert again == step and again.id == step.id
        assert graph_mod.plain(step.key) == step.key, step.label
        fn = graph_mod.function(step)
        assert f"{fn.__module__}:{fn.__qualname__}" == step.fn, step.label


@pytest.mark.slow
def test_studies_on_ray_write_what_inline_writes(store, monkeypatch, local_ray):
    """The studies of 06, 09 and 10 at sizes smaller than quick: their steps on a local Ray cluster of 2 workers
    (the runner's pre-pass), then the studies read them stored; every table's CSV equals the inline run's byte for
    byte, but for the timings. Both run one torch thread per step: torch's CPU reductions split their sums by thread
    count, which moves the 7th significant digit (the runner's --threads makes two runs comparable). 03, 07, 08 and 11
    run on the same executor with steps of the same kind: their steps are checked as data above and run inline under
    nbval, which keeps ~3 min out of make test."""
    import torch

    from harp_src.studies.frontier import FrontierParams, frontier_graph, frontier_study
    from harp_src.studies.recovery import RecoveryParams, recovery_graph, recovery_study
    from harp_src.studies.scale import ScaleParams, scale_graph, scale_study

    small = dict(N_CALIB=1, CALIB_LEN=64, N_EVAL=2, EVAL_LEN=64, SPEED_LENS=[16, 32], DECODE_STEPS=1)
    studies = [  # the task items are what costs minutes here: one LAMBADA item, where a study needs one at all
        (FrontierParams.defaults(METHODS=["flap:mlp"], LEVELS=[8], TASKS_MAIN=["lambada_openai"],
                                 LIMIT_MAIN=1, GOLD_TASKS=[], **small), frontier_graph, frontier_study),
        (ScaleParams.defaults(METHODS=["flap:mlp"], TASKS=["lambada_openai"], LIMIT=1, GOLD_TASKS=[], GEN_LIMIT=0,
                              TASK_METHODS=["best"], GEN_METHODS=[], **small), scale_graph, scale_study),
        (RecoveryParams.defaults(METHODS=["flap:mlp"], TASKS=[], FT_STEPS=1, FT_WINDOWS=1, FT_LEN=32,
                                 **{k: v for k, v in small.items() if not k.startswith(("SPEED", "DECODE"))}),
         recovery_graph, recovery_study),
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setenv(graph_mod.RUN_ENV, "inline")
        inline = [_csvs(study(p)) for p, _, study in studies]
    finally:
        torch.set_num_threads(before)
    monkeypatch.setattr(graph_mod, "PARTS", store / "ray-parts")
    monkeypatch.setenv(graph_mod.RUN_ENV, "ray")
    g = Graph()
    for p, declare, _ in studies:
        g.merge(declare(p)[0])
    out = executors.run_steps(g, reuse=False, executor="ray", workers=2, threads=1)
    assert not out.failed and len(out.computed) == len(g)
    assert {out.provenance[i]["threads"] for i in out.computed if not g.steps[i].alone} == {1}
    monkeypatch.setattr(executors, "compute",
                        lambda step, *a, **k: pytest.fail(f"a study computed {step.label or step.fn} again"))
    for (p, _, study), tables in zip(studies, inline, strict=True):
        ray_tables = _csvs(study(p))
        assert ray_tables.keys() == tables.keys()
        for name, text in ray_tables.items():
            assert text == tables[name], f"{p.NOTEBOOK} {name}"
