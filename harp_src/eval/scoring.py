"""Exact log-likelihood scoring of (context, continuation) token pairs, faster than one full forward per pair.

Two savings, neither of which changes a number beyond float rounding:
- the LM head (and log-softmax) runs only at the positions whose log-probabilities are needed: the last context
  token and the continuation tokens. Gemma-3's 262k-vocabulary head costs more than all of its layers;
- a token prefix shared by several requests is computed once and reused through the KV cache: the context of a
  multiple-choice question before its choices, a few-shot block shared by the items of one subject. Pruned (HARP)
  layers keep no K/V: an identity-bypassed token only reads itself, and a mean-bypassed layer keeps a running sum
  per row that counts only the tokens the attention mask marks real.

Requests are sorted so that shared prefixes are adjacent, then scored in blocks, cut where that saves the most
tokens (plan_blocks). A block may share a long prefix (computed once, batch 1); its groups (requests with one and the
same context) are batched, cut where the lengths jump so that little is padded (pack_batches), their context
remainders right-padded, with an attention mask that marks the padding (attention is causal, so no real position
would read a later padded one, but a mean-bypassed layer's running sum must not count it); then all continuations of
the batch run on copies of the cache, with an attention mask that hides the padding and explicit positions.
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..model.adapter import get_adapter
from ..model.weights import n_params

Request = tuple[list[int], list[int]]  # (context tokens, continuation tokens), as lm-eval builds them
MIN_SHARED = 32  # a prefix shorter than this across different contexts is not worth a cache copy
# what one more forward pass through the layers costs, in padded tokens: all the weights are read once per pass, and
# on 2 CPU cores that takes about as long as computing ~32 tokens. The LM head, read once per pass too, adds its share
FORWARD_COST = 32


@dataclass
class _Group:
    """Requests (indices) whose contexts are identical."""

    context: list[int]
    members: list[int]


@dataclass
class _Block:
    """Groups scored together: `shared` leading context tokens are common to all of them."""

    shared: int
    groups: list[_Group]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def _groups(requests: list[Request], order: list[int]) -> list[_Group]:
    groups: list[_Group] = []
    for i in order:
        if groups and groups[-1].context == requests[i][0]:
            groups[-1].members.append(i)
        else:
            groups.append(_Group(list(requests[i][0]), [i]))
    return groups


def _shared_runs(groups: list[_Group], min_shared: int) -> list[tuple[int, int, int]]:
    """Cut sorted groups into consecutive runs (start, end, shared) that save the most context tokens in all.

    A run of k groups whose contexts share s leading tokens computes them once instead of k times: it saves
    (k - 1) · s. Contexts are sorted, so a run's shared prefix is the smallest common prefix of neighbours inside
    it (and at most its shortest context less one token). Dynamic programming over the run ends finds the best cut;
    a run grown greedily from its first group would let one odd first item (a HumanEval prompt whose shots differ
    from the rest) cut every later item's shared prefix short. Runs that share fewer than `min_shared` tokens are
    single groups (shared = 0).
    """
    n = len(groups)
    common = [_common_prefix(groups[k].context, groups[k + 1].context) for k in range(n - 1)]
    saved = [0] * (n + 1)  # the best saving over groups[:end]
    last: list[tuple[int, int]] = [(0, 0)]  # (first, shared) of the last run in that best cut
    for end in range(1, n + 1):
        saved[end], best = saved[end - 1], (end - 1, 0)
        shared = len(groups[end - 1].context) - 1
        for first in range(end - 2, -1, -1):  # the last run is groups[first:end]
            shared = min(shared, common[first], len(groups[first].context) - 1)
            if shared < min_shared:
                break
            if saved[first] + (end - first - 1) * shared > saved[end]:
                saved[end], best = saved[first] + (end - first - 1) * shared, (first, shared)
        last.append(best)
    runs, end = [], n
    while end > 0:
        first, shared = last[end]
        runs.append((first, end, shared))
        end = first
    return runs[::-1]


def plan_blocks(requests: list[Request], min_shared: int = MIN_SHARED) -> list[_Block]:
    """Sort requests by their tokens and cut them into blocks: runs of groups that share a prefix of >= min_shared
    tokens (computed once per block, cut where that saves the most tokens, see _shared_runs), and between those,
    blocks of groups that share nothing (shared = 0).

    The shared part stops one token short of the shortest context in the block, so every group has at least its
    last context token left to run (that position predicts the first continuation token).
    """
    order = sorted(range(len(requests)), key=lambda i: (requests[i][0], requests[i][1]))
    groups = _groups(requests, order)
    blocks: list[_Block] = []
    for first, end, shared in _shared_runs(groups, min_shared):
        if shared == 0 and blocks and blocks[-1].shared == 0:  # single groups that share no long prefix are batched
            blocks[-1].groups += groups[first:end]
        else:
            blocks.append(_Block(shared, groups[first:end]))
    for block in blocks:  # similar lengths side by side: less padding in each batch
        block.groups.sort(key=lambda g: (len(g.context), max(len(requests[i][1]) for i in g.members)))
    return blocks


def pack_batches(widths: list[int], max_tokens: int, most_rows: int | None = None,
                 fits: Callable[[int, int], bool] | None = None, forward_cost: float = FORWARD_COST
                 ) -> list[tuple[int, int]]:
    """Cut rows sorted by width (ascending) into consecutive batches (first, end) that cost the fewest padded tokens.

    A batch runs as one right-padded forward: it costs `forward_cost` plus rows × its widest row. A batch of several
    rows must hold at most `max_tokens` padded tokens and `most_rows` rows, and pass `fits(first, end)` (a test
    that only gets harder as a batch grows); one row always runs. Cutting where the widths jump, rather than when a
    batch is full, keeps short multiple-choice continuations from being padded to the longest one of their batch.
    """
    if any(a > b for a, b in itertools.pairwise(widths)):
        raise ValueError("pack_batches needs the rows sorted by width, shortest first")
    cost, start = [0] + [math.inf] * len(widths), [0] * (len(widths) + 1)
    for end in range(1, len(widths) + 1):
        for first in range(end - 1, -1, -1):  # the last batch is rows first..end-1; its widest row is the last
            rows = end - first
            if rows > 1 and (rows * widths[end - 1] > max_tokens or (most_rows is not None and rows > most_rows)
                             or (fits is not None and not fits(first, end))):
                break
            if cost[first] + forward_cost + rows * widths[end - 1] < cost[end]:
                cost[end], start[end] = cost[first] + forward_cost + rows * widths[end - 1], first
    batches, end = [], len(widths)
    while end > 0:
        batches.append((start[end], end))
        end = start[end]
    return batches[::-1]


def _select_rows(cache, index: list[int], device: torch.device):
    """A copy of `cache` holding rows `index` (repeats allowed); the original is left as it is."""
    clone = copy.copy(cache)
    clone.layers = [copy.copy(layer) for layer in cache.layers]
    clone.batch_select_indices(torch.tensor(index, device=device))
    return clone


def _right_pad(rows: list[list[int]], device) -> torch.Tensor:
    width = max(len(r) for r in rows)
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


class _Scorer:
    """Runs the blocks of one call to score_requests on one model."""

    def __init__(self, model, requests: list[Request], max_batch_tokens: int, softmax_dtype, bar):
        self.model, self.requests, self.bar = model, requests, bar
        self.ad = get_adapter(model)
        self.decoder = model.get_decoder()
        self.device = next(model.parameters()).device
        self.max_batch_tokens, self.softmax_dtype = max_batch_tokens, softmax_dtype
        self.results: dict[int, tuple[float, bool]] = {}
        # Gemma-3's 262k-token head has more weights than its layers: each extra pass costs that much more
        body = n_params(self.ad.layers)
        self.forward_cost = FORWARD_COST * (1 + model.get_output_embeddings().weight.numel() / max(body, 1))

    def log_probs(self, normed: torch.Tensor) -> torch.Tensor:
        """Log-softmax over the vocabulary of final-normed states [n, d] -> [n, vocab], in `softmax_dtype`, by
        default float32 or wider: a bf16 log-softmax (8 significant bits) rounds each log-probability by up to
        ~0.4 % and the continuation sums add those errors up."""
        logits = self.ad.head_logits(normed)
        return F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype or torch.promote_types(logits.dtype,
                                                                                           torch.float32))

    def forward(self, ids: torch.Tensor, cache, mask=None, positions=None) -> torch.Tensor:
        out = self.decoder(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask, position_ids=positions)
        return out.last_hidden_state

    def window_fits(self, groups: list[_Group]) -> bool:
        """Whether `groups` may share one padded batch under sliding-window layers, whose window is counted in padded
        positions: no padded row (context and continuation) as long as the window."""
        window = self.ad.sliding_window
        if window is None or len(groups) == 1:
            return True
        width = max(len(g.context) for g in groups)
        return width + max(len(self.requests[i][1]) for g in groups for i in g.members) < window

    def run_block(self, block: _Block) -> None:
        shared_cache = None
        if block.shared:
            prefix = torch.tensor([block.groups[0].context[: block.shared]], device=self.device)
            shared_cache = _new_cache(self.model)
            self.forward(prefix, shared_cache)
        groups = block.groups  # sorted by context length: so are the remainders after the shared prefix
        widths = [len(g.context) - block.shared for g in groups]
        for first, end in pack_batches(widths, self.max_batch_tokens, fits=lambda a, b: self.window_fits(groups[a:b]),
                                       forward_cost=self.forward_cost):
            self.run_batch(block.shared, shared_cache, groups[first:end])

    def run_batch(self, shared: int, shared_cache, groups: list[_Group]) -> None:
        """Context remainders of `groups` (one row each), then every continuation on a copy of its row's cache."""
        rests = [g.context[shared:] for g in groups]
        cache = (_select_rows(shared_cache, [0] * len(groups), self.device) if shared_cache is not None
                 else _new_cache(self.model))
        mask = None
        if len(rests) > 1:  # the running sums of mean-bypassed layers must skip the padding
            width = max(len(r) for r in rests)
            mask = torch.zeros(len(rests), shared + width, dtype=torch.long, device=self.device)
            for k, r in enumerate(rests):
                mask[k, : shared + len(r)] = 1
        hidden = self.forward(_right_pad(rests, self.device), cache, mask)
        last = torch.stack([hidden[k, len(r) - 1] for k, r in enumerate(rests)])
        first = self.log_probs(last)  # [groups, vocab]: predicts each continuation's first token
        rows = [(k, i) for k, g in enumerate(groups) for i in g.members]
        multi = sorted([(k, i) for k, i in rows if len(self.requests[i][1]) > 1],
                       key=lambda row: len(self.requests[row[1]][1]))
        later = self.continuations(shared, cache, rests, multi)
        for k, i in rows:
            cont = self.requests[i][1]
            lp, greedy = first[k, cont[0]].item(), bool(first[k].argmax().item() == cont[0])
            if i in later:
                lp, greedy = lp + later[i][0], greedy and later[i][1]
            self.results[i] = (lp, greedy)
        self.bar.update(len(rows))

    def continuations(self, shared: int, cache, rests: list[list[int]], rows: list[tuple[int, int]]) -> dict:
        """{request: (log-prob of continuation tokens 2.., all of them greedy)} for requests with > 1 token.

        `rows` come sorted by continuation length and are cut into chunks by pack_batches; a chunk holds at most
        max_batch_tokens new tokens and four times that many cached positions (the cache is copied once per row).
        """
        width = max((len(r) for r in rests), default=0)
        steps = [len(self.requests[i][1]) - 1 for _, i in rows]
        most_rows = 4 * self.max_batch_tokens // (shared + width)
        out: dict[int, tuple[float, bool]] = {}
        for first, end in pack_batches(steps, self.max_batch_tokens, most_rows, forward_cost=self.forward_cost):
            out |= self.continuation_chunk(shared, cache, rests, rows[first:end], width)
        return out

    def continuation_chunk(self, shared: int, cache, rests, chunk, width: int) -> dict:
        conts = [self.requests[i][1] for _, i in chunk]
        ids = _right_pad([c[:-1] for c in conts], self.device)
        steps = ids.shape[1]
        rows_cache = _select_rows(cache, [k for k, _ in chunk], self.device)
        mask = positions = None
        if len(rests) > 1:  # rows came from contexts of different lengths: hide each row's padding
            mask = torch.zeros(len(chunk), shared + width + steps, dtype=torch.long, device=self.device)
            for row, (k, _) in enumerate(chunk):
                mask[row, : shared + len(rests[k])] = 1
            mask[:, shared + width :] = 1
            offsets = torch.tensor([shared + len(rests[k]) for k, _ in chunk], device=self.device)
            positions = offsets[:, None] + torch.arange(steps, device=self.device)
        hidden = self.forward(ids, rows_cache, mask, positions)
        picked = [(row, t) for row, c in enumerate(conts) for t in range(len(c) - 1)]
        lp = self.log_probs(hidden[[r for r, _ in picked], [t for _, t in picked]])
        targets = torch.tensor([conts[r][t + 1] for r, t in picked], device=self.device)
        token_lp = lp.gather(1, targets[:, None]).squeeze(1)
        hit = lp.argmax(-1) == targets
        out, pos = {}, 0
        for row, (_, i) in enumerate(chunk):
            n = len(conts[row]) - 1
            out[i] = (token_lp[pos : pos + n].sum().item(), bool(hit[pos : pos + n].all().item()))
            pos += n
        return out


def _new_cache(model) -> DynamicCache:
    """An empty cache as the model's own forward makes it (pruned layers get their no-storage slots)."""
    return DynamicCache(config=model.get_decoder().config)


@torch.no_grad()
def score_requests(model, requests: list[Request], max_batch_tokens: int = 768, min_shared: int = MIN_SHARED,
                   softmax_dtype: torch.dtype | None = None, progress: bool = False) -> list[tuple[float, bool]]:
    """log P(continuation | context) and whether greedy decoding reproduces the continuation, per request.

    Args:
        model: a causal LM of a supported family (dense or HARP-pruned).
        requests: (context tokens, continuation tokens) pairs, both non-empty; context + continuation must fit
            the model's context (callers truncate, as lm-eval does).
        max_batch_tokens: padded new tokens per forward (rows × width); larger batches pad more. 768 was the
            fastest on 2 CPU cores for SmolLM2 and Gemma-3 on ARC-Easy (512–1024 within 5 %).
        min_shared: shortest prefix that different contexts share before it is computed once for all of them.
        softmax_dtype: dtype of the log-softmax (lm-eval's `softmax_dtype`); None: the model's dtype promoted to
            at least float32, so a bf16 model's log-probabilities and their sums accumulate in float32.
    Returns:
        [(log-prob, is_greedy)] in the order of `requests`.
    """
    for ctx, cont in requests:
        if not ctx or not cont:
            raise ValueError("every request needs a non-empty context and continuation (lm-eval adds a prefix token)")
    with tqdm(total=len(requests), desc="log-likelihood requests (fast)", disable=not progress, leave=False) as bar:
        scorer = _Scorer(model, requests, max_batch_tokens, softmax_dtype, bar)
        for block in plan_blocks(requests, min_shared):
            scorer.run_block(block)
    return [scorer.results[i] for i in range(len(requests))]
