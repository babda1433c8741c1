"""Where `model.name` points, checked before any process starts: a kit model, a local folder, or
a hub id that is cached or reachable. Each wrong source is one line naming the value and what to do.

    check_model("kit:tiny-llama")          # None: fine
    check_model("meta-llama/Llama-3.1-8B") # offline and not cached: ConfigError at once

Without this, transformers retries an unreachable hub for about a minute and ends in a 270-line
traceback; a folder without config.json or a misspelt kit model fails deep inside from_pretrained.
Imports no torch: the launcher, the check step and the pre-flight call it; the ranks call it
again before loading. `check_with_model` holds what the config asks against what the model
allows (`model_facts`: its config through transformers' config class, defaults included, and its
class's attention support; no weights): the fused loss on a model whose logits pass through
softcapping or a scale after the head, or an attention implementation its class does not
support, is refused here in one line.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

from kit.config import ConfigError
from kit.inputs import builtin, model_folder

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
        model_folder.check_config(p, name)  # JSON; the weights after what config.json decides
        return
    if cached(name):
        return
    why = hub_reachable()
    if why:
        raise ConfigError(f"{field}: {name!r} is not a local folder nor in the Hugging Face "
                          f"cache, and the hub ({hub_host()}) cannot be reached from this "
                          f"machine ({why}); {how}")


# Config fields of models that transform the logits after the head (softcapping, scaling): the
# fused loss (kit.recipe.levers.loss) would skip that step, so it refuses them.
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


def fused_blocked(cfg, model_config: dict | None, facts: dict | None) -> str | None:
    """None when the fused loss can run this model (the planner asks); else why not."""
    targets = cfg.lora.target_modules
    if not isinstance(targets, str) and "lm_head" in targets:
        return "the output head trains (lora.target_modules has lm_head)"
    found = facts["logit_transforms"] if facts else logit_transforms(model_config or {})
    return f"the model's logits pass through {', '.join(found)} after the head" if found else None


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


def model_facts(name: str, trust_remote_code: bool = False) -> dict | None:
    """What transformers says of model.name without its weights (kit.inputs.families reads it):
    the config through its config class, so that values left at the class's default count (a
    saved config.json leaves them out), and the model class's declared attention support. None
    when no config is at hand (a hub id not cached). Imports transformers and torch: a rank calls
    it, the check step in a child process (kit.run.check.model_read)."""
    import inspect

    from transformers import AutoConfig, AutoModelForCausalLM

    if builtin.is_builtin(name):
        spec = dict(builtin.SPECS.get(name[len(builtin.PREFIX):]) or {})
        if not spec:
            return None
        from transformers.utils import logging

        before = logging.get_verbosity()
        logging.set_verbosity_error()  # the family's default token ids: the build sets the kit's
        try:
            config, where = AutoConfig.for_model(spec.pop("model_type"), **spec), None
        finally:
            logging.set_verbosity(before)
    else:
        where = str(Path(name).expanduser()) if kind(name) == "local" else name
        try:
            config = AutoConfig.from_pretrained(where, trust_remote_code=trust_remote_code,
                                                local_files_only=True)
        except (OSError, ValueError):
            return None
    text = config.get_text_config()
    facts = {"model_type": config.model_type, "logit_transforms": logit_transforms(
        config.to_dict()), "attn_logit_softcapping": getattr(text, "attn_logit_softcapping", None)}
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)
    ref = (getattr(config, "auto_map", None) or {}).get("AutoModelForCausalLM")
    if cls is None and ref and trust_remote_code and where:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        cls = get_class_from_dynamic_module(ref, where)
    if cls is None:
        return facts
    compatible = getattr(cls, "_compatible_flash_implementations", None)
    flash = bool(cls._supports_flash_attn) and (
        True if not compatible or "flash_attention_2" in compatible else list(compatible))
    # Attention sinks, for the refusal's words only (the class already declares no SDPA for them):
    # the modeling file hands them to the attention function as s_aux.
    sinks = "s_aux=" in inspect.getsource(inspect.getmodule(cls))
    return {**facts, "class": cls.__name__, "sinks": sinks, "attention": {
        "sdpa": bool(cls._supports_sdpa), "flex": bool(cls._supports_flex_attn), "flash": flash,
        "backend": bool(getattr(cls, "_supports_attention_backend", False))}}


def check_with_model(cfg, facts: dict | None = None) -> None:
    """Raise ConfigError for what the config asks of a model that the model does not allow: a
    mixture of experts whose experts the kit cannot train (kit.inputs.families.EXPERTS_REFUSED);
    the fused loss on logits softcapped or scaled after the head; an attention implementation its
    class does not support. `facts`: model_facts' answer (None: config.json alone)."""
    from kit.inputs import families

    config = model_config(cfg.model.name)
    if facts is None and config is None:
        return
    if line := families.experts_refusal(cfg.model.name, (facts or config).get("model_type")):
        raise ConfigError(line)
    transforms = facts["logit_transforms"] if facts else logit_transforms(config)
    if cfg.training.loss == "fused" and transforms:
        raise ConfigError(fused_loss_refusal(transforms))
    if cfg.attention.implementation != "auto" and (
            line := families.attention_refusal(cfg.attention.implementation, facts)):
        raise ConfigError(line)
