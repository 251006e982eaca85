"""Device placement and precision (issue 49, item 4), on the tiny random models of every family.

- No tensor of ours is made on the default device instead of the model's: the model stays on its device (the CPU, or
  `pytest --device cuda`'s GPU) while the default device is "meta", where a tensor has no data, so one made without
  `device=` makes a result wrong or raises.
- A bf16 copy of each model follows its fp32 original (HARP, the mean bypass, the fast scorer, fidelity) within bf16's
  rounding, and log-softmax and cumulative sums accumulate in float32, whatever the model's dtype.
"""

import copy
import math
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close
from transformers import DynamicCache

import harp_src
from conftest import DevicelessTensors, make_tiny
from harp_src import apply_harp, perplexity, search_alphas
from harp_src.eval import scoring
from harp_src.eval.fidelity import fidelity_windows, reference_states
from harp_src.eval.perplexity import nll_sum
from harp_src.measure.kv import kv_cache_bytes, prompt_kv_bytes
from harp_src.measure.timing import compare, decode_step, kv_bytes_formula, prefill, random_prompt
from harp_src.method.prefix import Boundaries
from harp_src.model.modeling_harp_mean import RunningMean, causal_mean
from harp_src.model.nll import next_token_nll, token_nll

OURS = str(Path(harp_src.__file__).resolve().parent)
# transformers' sliding-window cache layers make a tensor on the default device when they are built and move it to
# the model's device on first use: harmless on a GPU, impossible from "meta" (it has no data to copy). For the
# families with sliding-window layers only the tensors our own code makes are sent to "meta".
SLIDING = {"gemma2", "gemma3"}
PLAN = {1: 0.6, 2: 0.0, 3: 0.3}  # a bypass with α folded into o_proj (or Gemma's norm), a dropped layer, another α
LAYERS = sorted(PLAN)


def windows(n=2, t=16, seed=0, device="cpu") -> torch.Tensor:
    return torch.randint(3, 128, (n, t), generator=torch.Generator().manual_seed(seed), device="cpu").to(device)


def requests() -> list[tuple[list[int], list[int]]]:
    """Multiple-choice groups with 1- to 3-token continuations, two of them sharing a 6-token prefix."""
    shot = [11, 12, 13, 14, 15, 16]
    return [(shot + [20], [30]), (shot + [20], [31, 32]), (shot + [21, 22], [33, 34, 35]), (shot + [21, 22], [36]),
            ([40, 41], [42]), ([40, 41], [43, 44]), ([50], [51, 52, 53])]


def harp_copy(model, bypass: str):
    pruned = copy.deepcopy(model)
    apply_harp(pruned, LAYERS, PLAN, bypass=bypass)
    return pruned


# ---------------------------------------------------------------------------------------------- default device
@contextmanager
def default_device_meta(everywhere: bool, roots: tuple[str, ...] = (OURS,)):
    """Tensors made without `device=` land on "meta": every one of them (`everywhere`), or those made by `roots`."""
    if not everywhere:
        with DevicelessTensors(roots, send_to="meta"):
            yield
        return
    before = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(None if before.type == "cpu" else before)


def _frame(df, columns):
    return {c: torch.tensor(df[c].to_numpy(), device="cpu") for c in columns}


def devices(model, device: torch.device) -> list[int]:
    """1 per parameter or buffer of `model` on `device`, 0 per other one."""
    return [int(t.device == device) for t in [*model.parameters(), *model.buffers()]]


def everything(dense, device: torch.device) -> dict:
    """What HARP, the α search, the scorers, the NLL paths, fidelity and the KV/timing helpers compute on `dense`
    (left unchanged, on `device`), as tensors and numbers; every tensor the model's, or the CPU's for the numbers
    that pandas held."""
    ids, reqs, kw = windows(device=device), requests(), dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    harp, mean = harp_copy(dense, "identity"), harp_copy(dense, "mean")
    mask = torch.ones(2, 16, dtype=torch.long, device=device)
    mask[1, 12:] = 0  # right padding: the running means must skip it
    out = {"devices": devices(harp, device) + devices(mean, device)}  # the new modules (folded o_proj, α buffer) too
    with torch.no_grad():
        out |= {"harp_logits": harp(ids).logits, "mean_logits": mean(ids, attention_mask=mask).logits}
    out |= {"generate": harp.generate(ids[:1, :6], **kw), "generate_mean": mean.generate(ids[:1, :6], **kw)}
    search = copy.deepcopy(dense)
    recorded: dict = {}
    out["alphas"] = search_alphas(search, ids, layers=[2, 3], grid=(0.0, 0.5, 1.0), batch_size=1,
                                  window_nll=recorded)
    out["window_nll"] = {k: torch.as_tensor(v, device="cpu") for k, v in recorded.items()}
    out["alphas_naive_mean"] = search_alphas(search, ids, layers=[2, 3], grid=(0.0, 0.5, 1.0), batch_size=2,
                                             cache_prefix=False, bypass="mean")
    out["scores"] = [scoring.score_requests(m, reqs, max_batch_tokens=16, min_shared=3) for m in (dense, mean)]
    out["nll"] = (nll_sum(harp, ids, progress=False), perplexity(mean, ids, progress=False),
                  Boundaries(dense, ids, 2).nll_from(1))
    out["fidelity"] = _frame(fidelity_windows(dense, harp, ids, progress=False), ["kl", "top1_agreement", "nll"])
    out["fidelity_states"] = _frame(fidelity_windows(dense, mean, ids, progress=False,
                                                     ref_states=reference_states(dense, ids)), ["kl", "delta_nll"])
    prompt = random_prompt(128, 8, seed=0, device=device)
    _, first = prefill(harp, prompt)
    _, token = decode_step(harp, first.logits[:, -1:].argmax(-1), first.cache)
    out["kv"] = (prompt, token, kv_cache_bytes(first.cache), prompt_kv_bytes(mean, 8),
                 kv_bytes_formula(dense.config, 8, len(LAYERS), torch.bfloat16))
    summary, _ = compare(dense, harp, [8], repeats=1, warmup=1, decode_steps=2, progress=False)
    out["timing"] = _frame(summary, ["kv_bytes_dense", "kv_bytes_harp", "kv_bytes_expected", "flop_bound"])
    return out


def test_no_tensor_of_ours_is_made_on_the_default_device(family, device):
    dense = make_tiny(family, device=device)
    expected = everything(dense, device)
    assert all(expected["devices"])
    with default_device_meta(everywhere=family not in SLIDING):
        got = everything(dense, device)
    assert torch.get_default_device().type == "cpu"  # restored
    assert_close(got, expected)  # values and devices: a tensor left on "meta" fails here, if nothing raised before


def _made_without_device(x):
    return x + torch.zeros(x.shape)


def _made_on_its_device(x):
    return x + torch.zeros(x.shape, device=x.device)


@pytest.mark.parametrize("everywhere", [True, False], ids=["everywhere", "our-code"])
def test_the_check_catches_a_tensor_made_without_device(everywhere):
    """The check itself can fail: code under its roots (here this file) that makes a tensor without `device=`."""
    x = torch.ones(3)
    with default_device_meta(everywhere, roots=(__file__,)):
        with pytest.raises(RuntimeError, match="meta"):
            _made_without_device(x)
        fine = _made_on_its_device(x)
    assert_close(fine, torch.ones(3))


def test_a_device_test_on_the_cpu_refuses_a_tensor_made_without_device(device):
    """conftest's stand-in for a GPU run: on the CPU, a tensor that a test taking `device` (or harp_src under it)
    makes without `device=` is refused, as it would sit on the CPU beside a CUDA model."""
    if device.type != "cpu":
        pytest.skip("the stand-in is the CPU's: here the device itself checks")
    with pytest.raises(RuntimeError, match=r"test_precision.py:\d+: zeros\(\.\.\.\) without device="):
        torch.zeros(2)
    assert torch.zeros(2, device=device).device == device


# ---------------------------------------------------------------------------------------------- bf16
# bf16 keeps 8 significant bits: every weight and activation is rounded by up to 2^-8 ≈ 0.4 % of itself. Through 4
# layers of ~10 rounded operations each, the tiny models' logits move by 0.5–2.5 % of their largest value (measured:
# at most 0.019 of 0.76, Gemma-3). LOGIT_TOL allows 5 % of the largest fp32 logit, and each test also asserts that
# what HARP changes is several times larger, so a bf16 path that lost the bypass, its α or the padding would fail.
LOGIT_TOL = 0.05
# A log-probability is a logit minus the log-sum-exp of all of them, so it moves as much as the logits do: ≤ 0.008
# nats per token measured here; 0.02 per token allowed.
LOGPROB_TOL = 0.02
# a float32 sum of the same numbers in another order (or a float64 one) agrees to ~1e-7 relative; a bf16 log-softmax
# rounds each log-probability (≈ -4.85 here) by up to 2^-6 and is off by ~1e-3 relative: this tells the two apart
F32_SUM = dict(rtol=1e-6, atol=1e-6)


def bf16_pair(family, device):
    dense = make_tiny(family, device=device)
    return dense, copy.deepcopy(dense).to(torch.bfloat16)


@pytest.mark.parametrize("bypass", ["identity", "mean"])
def test_bf16_harp_follows_fp32(family, bypass, device):
    dense, dense16 = bf16_pair(family, device)
    harp, harp16 = harp_copy(dense, bypass), harp_copy(dense16, bypass)
    ids = windows(t=24, device=device)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0  # right padding, which the mean bypass's running sums must skip in bf16 too
    with torch.no_grad():
        want, got, before = (m(ids, attention_mask=mask).logits for m in (harp, harp16, dense))
    real = mask.bool()
    atol = LOGIT_TOL * want[real].abs().max().item()
    assert got.dtype == torch.bfloat16
    assert_close(got[real].float(), want[real], rtol=0, atol=atol)
    assert (want - before)[real].abs().max() > 4 * atol  # what HARP does is far outside the tolerance


def test_bf16_mean_bypass_keeps_its_running_sums_in_float32(device):
    _, dense16 = bf16_pair("llama", device)
    mean16 = harp_copy(dense16, "mean")
    ids = windows(n=1, t=10, device=device)
    cache = DynamicCache(config=mean16.get_decoder().config)
    with torch.no_grad():
        mean16(ids[:, :8], cache=cache, use_cache=True)
        step = mean16(ids[:, 8:], cache=cache, use_cache=True).logits
        whole = mean16(ids, use_cache=False).logits
    sums = [slot for slot in cache.layers if isinstance(slot, RunningMean)]
    assert len(sums) == 2 and all(s.sum.dtype == s.count.dtype == torch.float32 for s in sums)
    assert_close(sums[0].count, torch.tensor([[10.0]], device=device))
    # cached decoding follows the uncached forward (different shapes round differently in bf16)
    assert_close(step.float(), whole[:, 8:].float(), rtol=0, atol=LOGIT_TOL * whole.abs().max().item())


def test_causal_mean_accumulates_in_float32(device):
    """In bf16, 256 + 1 rounds back to 256: a bf16 cumulative sum of ones stalls there, and its mean of ones falls to
    0.25 by position 1024. The float32 sums give the float64 mean, rounded once to bf16 (rtol: one bf16 step)."""
    ones = torch.ones(1, 1024, 4, dtype=torch.bfloat16, device=device)
    assert_close(causal_mean(ones, None), ones, rtol=0, atol=0)
    v = torch.randn(2, 1024, 8, generator=torch.Generator().manual_seed(0), device="cpu").to(device, torch.bfloat16)
    exact = v.double().cumsum(1) / torch.arange(1, 1025, dtype=torch.float64, device=device)[None, :, None]
    got = causal_mean(v, None)
    assert got.dtype == torch.bfloat16
    assert_close(got.double(), exact, rtol=2**-8, atol=1e-5)
    state = RunningMean()
    halves = torch.cat([causal_mean(v[:, :600], None, state), causal_mean(v[:, 600:], None, state)], dim=1)
    assert state.sum.dtype == torch.float32 and state.count.dtype == torch.float32
    assert_close(halves.double(), exact, rtol=2**-8, atol=1e-5)


def _per_token(scores, reqs) -> torch.Tensor:
    return torch.tensor([lp / len(cont) for (lp, _), (_, cont) in zip(scores, reqs, strict=True)], device="cpu")


def test_bf16_fast_scorer_follows_fp32_and_softmaxes_in_float32(family, monkeypatch, device):
    dense, dense16 = bf16_pair(family, device)
    harp, harp16 = harp_copy(dense, "identity"), harp_copy(dense16, "identity")
    reqs = requests()
    seen = []
    log_probs = scoring._Scorer.log_probs

    def spy(self, normed):
        out = log_probs(self, normed)
        seen.append((self.ad, normed, out))
        return out

    monkeypatch.setattr(scoring._Scorer, "log_probs", spy)
    want = _per_token(scoring.score_requests(harp, reqs, min_shared=3), reqs)
    dense_lp = _per_token(scoring.score_requests(dense, reqs, min_shared=3), reqs)
    seen.clear()
    got = _per_token(scoring.score_requests(harp16, reqs, min_shared=3), reqs)
    assert_close(got, want, rtol=0, atol=LOGPROB_TOL)
    assert (want - dense_lp).abs().max() > 2 * LOGPROB_TOL  # HARP's change to the answers is outside the tolerance
    assert seen and all(normed.dtype == torch.bfloat16 for _, normed, _ in seen)
    for ad, normed, out in seen:  # the bf16 model's logits, log-softmaxed in float32
        assert out.dtype == torch.float32
        assert_close(out, F.log_softmax(ad.head_logits(normed).float(), dim=-1))


def test_bf16_nll_accumulates_in_float32(family, device):
    """Every NLL path (perplexity, the α search's cached boundaries, token_nll) of a bf16 model equals the NLL of its
    logits upcast to float32."""
    _, dense16 = bf16_pair(family, device)
    ids = windows(t=32, device=device)
    with torch.no_grad():
        logits = dense16(ids).logits
    assert logits.dtype == torch.bfloat16
    exact = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="none").cpu()
    total, count = nll_sum(dense16, ids, batch_size=1, progress=False)
    assert count == exact.numel()
    assert_close(torch.tensor(total, device="cpu"), exact.sum(), **F32_SUM)
    assert_close(math.log(perplexity(dense16, ids, progress=False)), exact.mean().item(), **F32_SUM)
    assert_close(torch.tensor(Boundaries(dense16, ids, 2, chunk=8).nll_from(0)[0], device="cpu"), exact.sum(),
                 **F32_SUM)
    nll = next_token_nll(logits, ids)
    assert nll.dtype == token_nll(logits[:, :1], ids[:, :1]).dtype == torch.float32
    assert_close(nll.cpu(), exact)


def test_bf16_fidelity_follows_fp32(family, device):
    dense, dense16 = bf16_pair(family, device)
    harp, harp16 = harp_copy(dense, "identity"), harp_copy(dense16, "identity")
    ids = windows(t=32, device=device)
    want = fidelity_windows(dense, harp, ids, progress=False)
    got = fidelity_windows(dense16, harp16, ids, progress=False)
    cols = lambda df, c: torch.tensor(df[c].to_numpy(), device="cpu")  # noqa: E731
    # KL of HARP from dense is ~0.005 nats here; bf16 moves it by < 1 % (measured 0.5 %): 5 % allowed. The NLLs
    # (~4.9 nats) and their difference move by ≤ 1.1e-3 (measured): 5e-3 allowed. Top-1 agreement counts 31
    # predictions per window, near ties in a random model's almost uniform distribution: two may flip.
    assert_close(cols(got, "kl"), cols(want, "kl"), rtol=0.05, atol=1e-5)
    for c in ("nll_reference", "nll", "delta_nll"):
        assert_close(cols(got, c), cols(want, c), rtol=0, atol=5e-3)
    assert_close(cols(got, "top1_agreement"), cols(want, "top1_agreement"), rtol=0, atol=2 / 31 + 1e-9)
    with torch.no_grad():  # the bf16 models' NLLs come from their logits log-softmaxed in float32
        for m, c in ((dense16, "nll_reference"), (harp16, "nll")):
            per = F.cross_entropy(m(ids).logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
            assert_close(cols(got, c), per.double().mean(1).cpu(), **F32_SUM)
