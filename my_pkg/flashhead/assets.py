"""FlashHead assets: reading the LM head of a Hugging Face checkpoint and the clustering cache.

Cache layout (compatible with the public FlashHead plugin)::

    MODEL_DIR/config.json                      + "flash_head_cache_dir": "flash_head_assets",
                                                 "n_probes": P, "architectures": ["FlashHead<Arch>"]
    MODEL_DIR/flash_head_assets/clustering_cache.safetensors
        centroids            float32 [hidden, clusters]   (hidden-major; leading singleton dims accepted)
        cluster_assignments  int64   [vocab]              (cluster id of every vocabulary row)
    MODEL_DIR/flash_head_assets/tail_estimate.safetensors      (optional; read by this package only)
        left, right          float32 [hidden, rank]       (factors of sampled rows' tail estimate,
                                                             fitted to the calibration states)

Assets whose clusters are not all the same size (vocabulary not a multiple of the cluster
size) load here but not in the public plugin, which requires equal sizes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .tail_estimate import TailFactors

__all__ = [
    "FlashHeadAssetError",
    "CACHE_DIR_NAME",
    "CACHE_FILE_NAME",
    "TAIL_FILE_NAME",
    "CALIBRATION_KEY",
    "read_config",
    "find_head_key",
    "load_lm_head",
    "save_clustering_cache",
    "load_clustering_cache",
    "load_assets",
    "save_tail_factors",
    "load_tail_factors",
    "update_config",
    "flashhead_architecture",
    "prepare_output_dir",
    "text_config",
]

CACHE_DIR_NAME = "flash_head_assets"
CACHE_FILE_NAME = "clustering_cache.safetensors"
TAIL_FILE_NAME = "tail_estimate.safetensors"
CALIBRATION_KEY = "flash_head_calibration"
ARCH_PREFIX = "FlashHead"

_LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")
_EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "model.model.embed_tokens.weight",
    "embed_tokens.weight",
    "transformer.wte.weight",
    "model.decoder.embed_tokens.weight",
    "transformer.word_embeddings.weight",
    "gpt_neox.embed_in.weight",
)


class FlashHeadAssetError(Exception):
    """A model directory or FlashHead cache is missing, unreadable or inconsistent."""


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir) / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FlashHeadAssetError(f"{path} not found") from None
    except (OSError, ValueError) as e:
        raise FlashHeadAssetError(f"cannot read {path}: {e}") from None


def text_config(config: dict) -> dict:
    """The text sub-config of multimodal configs (Gemma-3 etc.), else ``config`` itself."""
    sub = config.get("text_config")
    return sub if isinstance(sub, dict) else config


def _tied(config: dict) -> bool:
    for c in (config, text_config(config)):
        if c.get("tie_word_embeddings") is True:
            return True
    return False


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Map tensor name -> safetensors file."""
    index = model_dir / "model.safetensors.index.json"
    single = model_dir / "model.safetensors"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise FlashHeadAssetError(f"cannot read {index}: {e}") from None
        return {k: model_dir / v for k, v in weight_map.items()}
    if single.exists():
        from safetensors import safe_open

        try:
            with safe_open(str(single), framework="pt") as f:
                return {k: single for k in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a bad file
            raise FlashHeadAssetError(f"cannot read {single}: {e}") from None
    raise FlashHeadAssetError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def find_head_key(keys, config: dict) -> str:
    """Name of the LM head tensor: the input embedding when embeddings are tied (or no
    ``lm_head`` exists), else ``lm_head.weight`` (or a prefixed variant)."""
    keys = set(keys)
    lm = [k for k in _LM_HEAD_KEYS if k in keys]
    emb = [k for k in _EMBED_KEYS if k in keys]
    if not emb:
        emb = sorted(k for k in keys if k.endswith("embed_tokens.weight"))
    if lm and not _tied(config):
        return lm[0]
    if emb:
        return emb[0]
    if lm:
        return lm[0]
    raise FlashHeadAssetError("no LM head found: expected one of " + ", ".join(_LM_HEAD_KEYS + _EMBED_KEYS[:2]))


def load_lm_head(model_dir: str | Path, config: dict | None = None) -> tuple[torch.Tensor, str]:
    """Return ``(weight [V, H], tensor name)`` of the checkpoint's LM head."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FlashHeadAssetError(f"{model_dir} is not a directory")
    config = read_config(model_dir) if config is None else config
    files = _weight_files(model_dir)
    key = find_head_key(files.keys(), config)
    from safetensors import safe_open

    path = files[key]
    try:
        with safe_open(str(path), framework="pt") as f:
            w = f.get_tensor(key)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a bad file
        raise FlashHeadAssetError(f"cannot read tensor {key!r} from {path}: {e}") from None
    if w.dim() != 2:
        raise FlashHeadAssetError(f"LM head {key!r} must be 2-D, got shape {tuple(w.shape)}")
    return w, key


def save_clustering_cache(model_dir: str | Path, centroids: torch.Tensor, assignments: torch.Tensor) -> Path:
    """Write ``flash_head_assets/clustering_cache.safetensors`` (centroids given as ``[C, H]``)."""
    from safetensors.torch import save_file

    out = Path(model_dir) / CACHE_DIR_NAME
    out.mkdir(parents=True, exist_ok=True)
    path = out / CACHE_FILE_NAME
    save_file(
        {
            "centroids": centroids.detach().float().t().contiguous().cpu(),
            "cluster_assignments": assignments.detach().to(torch.int64).contiguous().cpu(),
        },
        str(path),
    )
    return path


def _read_tensors(path: Path, *names: str) -> list[torch.Tensor]:
    """The tensors ``names`` of the safetensors file ``path``; :class:`FlashHeadAssetError` when it cannot be
    read or lacks one."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            missing = set(names) - set(f.keys())
            if missing:
                raise FlashHeadAssetError(f"{path}: missing tensor(s) {sorted(missing)}")
            return [f.get_tensor(name) for name in names]
    except FlashHeadAssetError:
        raise
    except Exception as e:  # noqa: BLE001 - safetensors raises its own types for a bad file
        raise FlashHeadAssetError(f"cannot read {path}: {e}") from None


def load_clustering_cache(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a cache file; return ``(centroids [C, H] float32, assignments [V] int64)`` without
    cross-checking against a model (see :func:`load_assets`)."""
    path = Path(path)
    if not path.exists():
        raise FlashHeadAssetError(f"{path} not found")
    cent, assign = _read_tensors(path, "centroids", "cluster_assignments")
    while cent.dim() > 2 and cent.shape[0] == 1:
        cent = cent[0]
    if cent.dim() != 2:
        raise FlashHeadAssetError(f"{path}: centroids must be [hidden, clusters], got {tuple(cent.shape)}")
    while assign.dim() > 1 and assign.shape[0] == 1:
        assign = assign[0]
    if assign.dim() != 1:
        raise FlashHeadAssetError(f"{path}: cluster_assignments must be 1-D, got {tuple(assign.shape)}")
    if assign.is_floating_point() or assign.dtype == torch.bool:
        raise FlashHeadAssetError(f"{path}: cluster_assignments must be integer, got {assign.dtype}")
    return cent.t().float().contiguous(), assign.to(torch.int64)


def _cache_dir(model_dir: str | Path, config: dict) -> Path:
    cache_dir = Path(config.get("flash_head_cache_dir", CACHE_DIR_NAME))
    return cache_dir if cache_dir.is_absolute() else Path(model_dir) / cache_dir


def save_tail_factors(model_dir: str | Path, factors: TailFactors) -> Path:
    """Write ``flash_head_assets/tail_estimate.safetensors`` (the fitted factors of the tail estimate)."""
    from safetensors.torch import save_file

    out = Path(model_dir) / CACHE_DIR_NAME
    out.mkdir(parents=True, exist_ok=True)
    path = out / TAIL_FILE_NAME
    tensors = {"left": factors.left, "right": factors.right}
    save_file({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, str(path))
    return path


def load_tail_factors(model_dir: str | Path, config: dict) -> TailFactors | None:
    """The fitted factors of the tail estimate, or None when the assets have none (a weight-only build, or
    assets from elsewhere: sampled rows then use the weight-only estimate).  Raises
    :class:`FlashHeadAssetError` for a file that is unreadable or does not fit the model's hidden size."""
    path = _cache_dir(model_dir, config) / TAIL_FILE_NAME
    if not path.exists():
        return None
    left, right = _read_tensors(path, "left", "right")
    hidden = text_config(config).get("hidden_size", config.get("hidden_size"))
    if left.dim() != 2 or left.shape != right.shape or left.shape[1] == 0:
        raise FlashHeadAssetError(
            f"{path}: left and right must both be [hidden, rank], got {tuple(left.shape)} and {tuple(right.shape)}"
        )
    if hidden is not None and left.shape[0] != int(hidden):
        raise FlashHeadAssetError(f"{path}: hidden size {left.shape[0]} != model hidden_size {hidden}")
    if not (torch.isfinite(left).all() and torch.isfinite(right).all()):
        raise FlashHeadAssetError(f"{path}: non-finite values")
    return TailFactors(left.float().contiguous(), right.float().contiguous())


def load_assets(model_dir: str | Path, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Load and validate a model's FlashHead assets.

    Returns ``(centroids [C, H] float32, assignments [V] int64)``.  Checks: the cache exists
    under ``config["flash_head_cache_dir"]`` (default ``flash_head_assets``), the hidden size
    matches ``hidden_size`` of the (text) config, there is one assignment per vocabulary row
    (``vocab_size``), every cluster id is in ``[0, C)`` and every cluster is non-empty.
    Raises :class:`FlashHeadAssetError`.
    """
    cent, assign = load_clustering_cache(_cache_dir(model_dir, config) / CACHE_FILE_NAME)
    tc = text_config(config)
    hidden = tc.get("hidden_size", config.get("hidden_size"))
    vocab = tc.get("vocab_size", config.get("vocab_size"))
    c, h = cent.shape
    if hidden is not None and h != int(hidden):
        # A [C, H] file mistakenly written clusters-major is recognisable by its shape.
        raise FlashHeadAssetError(f"centroid hidden size {h} != model hidden_size {hidden}")
    if vocab is not None and assign.numel() != int(vocab):
        raise FlashHeadAssetError(f"{assign.numel()} cluster assignments != model vocab_size {vocab}")
    if assign.numel() == 0 or int(assign.min()) < 0 or int(assign.max()) >= c:
        raise FlashHeadAssetError(f"cluster ids must lie in [0, {c})")
    if int(torch.bincount(assign, minlength=c).min()) == 0:
        raise FlashHeadAssetError("some clusters have no member")
    if not torch.isfinite(cent).all():
        raise FlashHeadAssetError("centroids contain non-finite values")
    n_probes = config.get("n_probes")
    if n_probes is not None and not (isinstance(n_probes, int) and 1 <= n_probes <= c):
        raise FlashHeadAssetError(f"n_probes must be an int in [1, {c}], got {n_probes!r}")
    return cent, assign


def flashhead_architecture(name: str) -> str:
    """``LlamaForCausalLM`` -> ``FlashHeadLlamaForCausalLM`` (idempotent)."""
    return name if name.startswith(ARCH_PREFIX) else ARCH_PREFIX + name


def update_config(model_dir: str | Path, n_probes: int, calibration: dict | None = None) -> dict:
    """Add the FlashHead keys to ``config.json`` and prefix the architectures; returns the new config.

    ``calibration``: what a data-aware build measured, kept under ``flash_head_calibration``; a
    weight-only build (None) removes a stale record.
    """
    path = Path(model_dir) / "config.json"
    config = read_config(model_dir)
    config["flash_head_cache_dir"] = CACHE_DIR_NAME
    config["n_probes"] = int(n_probes)
    if calibration is None:
        config.pop(CALIBRATION_KEY, None)
    else:
        config[CALIBRATION_KEY] = calibration
    archs = config.get("architectures") or []
    config["architectures"] = [flashhead_architecture(a) for a in archs]
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    tmp.replace(path)
    return config


def prepare_output_dir(model_dir: str | Path, output: str | Path) -> Path:
    """Copy ``model_dir`` to ``output`` (files overwritten, re-running is safe)."""
    src, dst = Path(model_dir).resolve(), Path(output).resolve()
    if src == dst:
        return dst
    if dst.is_relative_to(src):
        raise FlashHeadAssetError("--output must not lie inside the model directory")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst


def _ids(value) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def stop_and_special_token_ids(model_dir: str | Path | None, config: dict) -> list[int]:
    """Token ids whose logits FlashHead always scores exactly (its "pinned" candidates).

    The model's end-of-sequence ids (config.json and generation_config.json
    `eos_token_id`) and the tokenizer's special tokens (`added_tokens_decoder`
    entries marked special in tokenizer_config.json): a missed EOS would run a
    reply on to `max_tokens`. Files that are absent or unreadable add nothing.
    """
    ids = set(_ids(text_config(config).get("eos_token_id")) + _ids(config.get("eos_token_id")))
    if model_dir is not None:
        root = Path(model_dir)
        for name, read in (
            ("generation_config.json", lambda d: _ids(d.get("eos_token_id"))),
            ("tokenizer_config.json", _special_added_tokens),
        ):
            try:
                ids.update(read(json.loads((root / name).read_text())))
            except (OSError, ValueError, AttributeError, TypeError):
                continue
    return sorted(i for i in ids if i >= 0)


def _special_added_tokens(tokenizer_config: dict) -> list[int]:
    added = tokenizer_config.get("added_tokens_decoder") or {}
    return [
        int(token_id)
        for token_id, entry in added.items()
        if isinstance(entry, dict) and entry.get("special") and str(token_id).isdigit()
    ]
