"""Where `model.name` points, checked before any process starts: a kit model, a local folder, or
a hub id that is cached or reachable. Each wrong source is one line naming the value and what to do.

    check_model("kit:tiny-llama")          # None: fine
    check_model("meta-llama/Llama-3.1-8B") # offline and not cached: ConfigError at once

Without this, transformers retries an unreachable hub for about a minute and ends in a 270-line
traceback; a folder without config.json or a misspelt kit model fails deep inside from_pretrained.
Imports no torch: the launcher, the check step and the pre-flight call it; the ranks call it
again before loading. `check_with_model` reads the model's config.json (no weights) for what the
config asks of the model: the fused loss on a model whose logits pass through softcapping or a
scale after the head is refused here, in the line the ranks would say after loading.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from kit.config import ConfigError
from kit.inputs import builtin

HUB_TIMEOUT_S = 3.0  # one TCP connect: answers "is there a network" without a minute of retries


def kind(name: str) -> str:
    """kit | local | hub: how the kit will load model.name."""
    if builtin.is_builtin(name):
        return "kit"
    p = Path(name).expanduser()
    if p.exists() or name.startswith(("/", "./", "../", "~")) or name.count("/") > 1:
        return "local"
    return "hub"


def hub_host() -> str:
    return urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co").hostname or ""


def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> str:
    """"" when the hub answers a TCP connect, else why not (the library's own words)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"):
        return "HF_HUB_OFFLINE is set"
    try:
        socket.create_connection((hub_host(), 443), timeout=timeout).close()
        return ""
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def cached(repo_id: str) -> bool:
    """Whether the hub id's config.json is already in the local Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # noqa: BLE001 - an id the cache cannot even look up: not cached
        return False


def check_model(name: str) -> None:
    """Raise ConfigError (one line) unless model.name can be loaded from where it points."""
    field = "model.name"
    how = "download it where there is a network and set model.name to that local folder"
    if builtin.is_builtin(name):
        if name[len(builtin.PREFIX):] not in builtin.SPECS:
            allowed = ", ".join(builtin.PREFIX + k for k in builtin.SPECS)
            raise ConfigError(f"{field}: {name!r} is not a kit model; allowed: {allowed}")
        return
    if kind(name) == "local":
        p = Path(name).expanduser()
        if not p.exists():
            raise ConfigError(f"{field}: {name!r} does not exist; expected a local model folder, "
                              "a hub id (org/name) or kit:<name>")
        if not p.is_dir():
            raise ConfigError(f"{field}: {name!r} is a file; expected a model folder (what "
                              "save_pretrained writes: config.json and the weights)")
        if not (p / "config.json").is_file():
            raise ConfigError(f"{field}: {name!r} has no config.json; expected a model folder "
                              "(what save_pretrained writes: config.json and the weights)")
        return
    if cached(name):
        return
    why = hub_reachable()
    if why:
        raise ConfigError(f"{field}: {name!r} is not a local folder nor in the Hugging Face "
                          f"cache, and the hub ({hub_host()}) cannot be reached from this "
                          f"machine ({why}); {how}")


# Config fields of models that transform the logits after the head (softcapping, scaling): the
# fused loss (kit.recipe.loss) would skip that step, so it refuses them.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                    "output_multiplier_scale")


def logit_transforms(config: dict) -> list[str]:
    """The LOGIT_TRANSFORMS a model config sets (to other than 1): a dict, or a transformers
    config's to_dict(); multimodal configs' text_config counts too."""
    configs = [config, config.get("text_config") or {}]
    return [f for f in LOGIT_TRANSFORMS if any(c.get(f) not in (None, 1, 1.0) for c in configs)]


def fused_loss_refusal(transforms: list[str]) -> str:
    return (f"training.loss: 'fused' is not allowed for this model; its logits pass through "
            f"{', '.join(transforms)} after the head; allowed: hf, chunked")


def model_config(name: str) -> dict | None:
    """model.name's config.json as a dict, without weights or transformers: a kit model's spec, a
    local folder's file, or the Hugging Face cache's copy; None when none is at hand."""
    if builtin.is_builtin(name):
        return builtin.SPECS.get(name[len(builtin.PREFIX):])
    path = Path(name).expanduser() / "config.json" if kind(name) == "local" else None
    if path is None:
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(name, "config.json")
        except Exception:  # noqa: BLE001 - an id the cache cannot look up: not at hand
            return None
        path = Path(found) if isinstance(found, str) else None
    try:
        return json.loads(path.read_text()) if path else None
    except (OSError, ValueError):
        return None


def check_with_model(cfg) -> None:
    """Raise ConfigError for what the config asks of a model whose config.json says otherwise."""
    config = model_config(cfg.model.name)
    if config is None:
        return
    if cfg.training.loss == "fused" and (transforms := logit_transforms(config)):
        raise ConfigError(fused_loss_refusal(transforms))
