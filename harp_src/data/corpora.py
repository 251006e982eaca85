"""Offline corpora (gensim's packaged Wikipedia excerpt and Lee news corpus) and perplexity windows.

Articles are split by index into train (calibration, α search) and test (evaluation), so α is never tuned on
test text. data/manifest.json pins the sha256 of every extracted split.
"""

from __future__ import annotations

import bz2
import hashlib
import importlib.metadata
import json
import re
from pathlib import Path

import numpy as np
import torch

from ..model.loading import cache_dir
from ..report.files import ROOT, atomic_path, write_json, write_text

MANIFEST = ROOT / "data" / "manifest.json"
CORPORA = ("enwiki", "lee")
SPLITS = ("train", "test")
TEST_EVERY = 5  # article i is test text when i % 5 == 4 (~20 %)
MIN_ARTICLE_CHARS = 500


def _gensim_data() -> Path:
    try:
        import gensim
    except ImportError as err:
        raise ModuleNotFoundError("the corpora come from gensim's test data: pip install gensim==4.4.0") from err
    return Path(gensim.__file__).parent / "test" / "test_data"


def _enwiki_articles() -> list[str]:
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    path = _gensim_data() / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    articles = []
    with bz2.open(path) as handle:
        for _title, text, _pageid in extract_pages(handle):
            if text.lstrip().upper().startswith("#REDIRECT"):
                continue
            clean = re.sub(r"\n{3,}", "\n\n", filter_wiki(text)).strip()
            if len(clean) >= MIN_ARTICLE_CHARS:
                articles.append(clean)
    return articles


def _lee_articles() -> list[str]:
    lines = (_gensim_data() / "lee_background.cor").read_text(encoding="utf-8", errors="replace").splitlines()
    return [line.strip() for line in lines if line.strip()]


def _extract(corpus: str) -> dict[str, str]:
    articles = _enwiki_articles() if corpus == "enwiki" else _lee_articles()
    articles = list(dict.fromkeys(articles))  # the Lee corpus repeats 7 documents; a split must not leak
    return {
        "train": "\n\n".join(a for i, a in enumerate(articles) if i % TEST_EVERY != TEST_EVERY - 1),
        "test": "\n\n".join(a for i, a in enumerate(articles) if i % TEST_EVERY == TEST_EVERY - 1),
    }


def _check_name(corpus: str, split: str) -> None:
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus '{corpus}': choose one of {CORPORA}")
    if split not in SPLITS:
        raise ValueError(f"unknown split '{split}': choose one of {SPLITS}")


def corpus_text(corpus: str = "enwiki", split: str = "test") -> str:
    """The plain text of one split, extracted once into the cache and checked against data/manifest.json."""
    _check_name(corpus, split)
    path = cache_dir() / "data" / f"{corpus}_{split}.txt"
    if not path.exists():
        for name, text in _extract(corpus).items():
            write_text(path.with_name(f"{corpus}_{name}.txt"), text)
    text = path.read_text(encoding="utf-8")
    expected = json.loads(MANIFEST.read_text())["files"].get(f"{corpus}_{split}.txt", {}).get("sha256")
    found = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if expected and found != expected:
        raise ValueError(
            f"extracted {corpus}/{split} has sha256 {found}, data/manifest.json expects {expected}: "
            f"check the gensim version ({json.loads(MANIFEST.read_text())['source']}), or delete {path.parent}"
        )
    return text


def bos_id(tok) -> int | None:
    """The BOS id when the tokenizer itself adds one (Gemma does, SmolLM2 and Qwen do not)."""
    probe = tok("a")["input_ids"]
    return probe[0] if tok.bos_token_id is not None and probe and probe[0] == tok.bos_token_id else None


def _token_ids(tok, corpus: str, split: str) -> np.ndarray:
    probe = tok("The quick brown fox, 1234.", add_special_tokens=False)["input_ids"]
    key = hashlib.sha1(f"{tok.name_or_path}|{len(tok)}|{probe}".encode()).hexdigest()[:12]
    path = cache_dir() / "tokens" / f"{corpus}_{split}_{key}.npy"
    if path.exists():
        return np.load(path)
    ids = np.asarray(tok(corpus_text(corpus, split), add_special_tokens=False)["input_ids"], dtype=np.int64)
    with atomic_path(path) as tmp:
        np.save(tmp, ids)
    return ids


def ppl_windows(
    tok, corpus: str = "enwiki", split: str = "test", n_windows: int = 16, seq_len: int = 512, seed: int = 0
) -> torch.Tensor:
    """Non-overlapping token windows drawn at random (seeded) from one corpus split.

    Args:
        tok: the model's tokenizer; a BOS token starts each window when the tokenizer adds one.
        corpus: "enwiki" (Wikipedia) or "lee" (news, out of domain).
        split: "train" for calibration/search, "test" for evaluation.
        n_windows, seq_len: how many windows of how many tokens (BOS included).
        seed: picks which windows; a local generator, global RNG untouched.
    Returns:
        LongTensor [n_windows, seq_len]
    """
    _check_name(corpus, split)
    if int(n_windows) < 1 or int(seq_len) < 2:
        raise ValueError(f"need n_windows >= 1 and seq_len >= 2, got {n_windows} and {seq_len}")
    bos = bos_id(tok)
    body = seq_len - (bos is not None)
    ids = _token_ids(tok, corpus, split)
    available = len(ids) // body
    if n_windows > available:
        raise ValueError(
            f"{corpus}/{split} has {len(ids)} tokens: at most {available} windows of {seq_len} tokens, "
            f"asked for {n_windows}; lower n_windows or seq_len"
        )
    chosen = np.sort(np.random.default_rng(seed).choice(available, size=n_windows, replace=False))
    windows = np.stack([ids[c * body : (c + 1) * body] for c in chosen])
    if bos is not None:
        windows = np.concatenate([np.full((n_windows, 1), bos, dtype=np.int64), windows], axis=1)
    return torch.from_numpy(windows)


def disjoint_samples(pool: torch.Tensor, n_samples: int, sizes: list[int]) -> dict[int, list[torch.Tensor]]:
    """`n_samples` disjoint calibration samples of each size (in windows) cut from one pool of distinct windows
    (`ppl_windows(tok, "enwiki", "train", ...)`): sample s of every size starts at window s · max(sizes), so the
    samples of one size share no window and the smaller sizes are nested in the larger ones (paired across sizes).

    Returns:
        {size: [n_samples tensors of shape [size, T]]}; the pool's windows from n_samples · max(sizes) on are unused.
    """
    sizes = sorted({int(n) for n in sizes})
    if int(n_samples) < 1 or not sizes or sizes[0] < 1:
        raise ValueError(f"need n_samples >= 1 and sizes >= 1, got {n_samples} and {sizes}")
    stride = sizes[-1]
    if n_samples * stride > len(pool):
        raise ValueError(f"{n_samples} disjoint samples of {stride} windows need {n_samples * stride} windows, the "
                         f"pool has {len(pool)}: draw a larger pool or ask for fewer or smaller samples")
    return {n: [pool[s * stride : s * stride + n] for s in range(n_samples)] for n in sizes}


def calibration_samples(tok, n_samples: int, sizes: list[int], seq_len: int, seed: int = 0, extra: int = 0
                        ) -> tuple[dict[int, list[torch.Tensor]], torch.Tensor]:
    """`n_samples` disjoint enwiki-*train* samples of each size in `sizes` (windows of `seq_len` tokens; see
    `disjoint_samples`), and one more sample of `extra` windows disjoint from all of them.

    Returns:
        ({size: [n_samples tensors [size, seq_len]]}, the extra sample [extra, seq_len])
    """
    stride = max(int(n) for n in sizes) if len(sizes) else 0
    if int(extra) < 0:
        raise ValueError(f"extra must be >= 0 windows, got {extra}")
    pool = ppl_windows(tok, "enwiki", "train", max(1, n_samples * stride + int(extra)), seq_len, seed)
    return disjoint_samples(pool, n_samples, sizes), pool[n_samples * stride :]


def build_manifest() -> dict:
    """Re-extract every split and write data/manifest.json (run after changing the extraction rules)."""
    files = {}
    for corpus in CORPORA:
        for split, text in _extract(corpus).items():
            files[f"{corpus}_{split}.txt"] = {
                "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
                "chars": len(text),
            }
    manifest = {
        "source": f"gensim=={importlib.metadata.version('gensim')} (PyPI), gensim/test/test_data/",
        "inputs": {
            "enwiki": "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2",
            "lee": "lee_background.cor",
        },
        "rule": f"duplicates, redirects and articles under {MIN_ARTICLE_CHARS} chars dropped; markup stripped by "
        f"gensim filter_wiki; article i is test when i % {TEST_EVERY} == {TEST_EVERY - 1}",
        "files": files,
    }
    write_json(MANIFEST, manifest)
    return manifest


if __name__ == "__main__":
    print(json.dumps(build_manifest(), indent=1))
