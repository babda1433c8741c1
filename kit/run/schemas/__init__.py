"""The Kubeflow CRDs the kit writes manifests for (copies: README.md), and a strict check of one.

    problems = validate(manifest)   # [] when the TrainJob / PyTorchJob dict fits its CRD

Strict: an object whose schema lists its properties takes no other field, as `kubectl apply
--validate=strict` refuses unknown fields that the API server would otherwise drop without a
word (a misspelt `numNodes` would silently run one node). Kernel side: no torch; jsonschema is
imported when a manifest is checked.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import yaml

FOLDER = Path(__file__).resolve().parent
# (apiVersion, kind) -> the CRD file that defines it.
CRDS = {
    ("trainer.kubeflow.org/v1alpha1", "TrainJob"): "trainer.kubeflow.org_trainjobs.yaml",
    ("kubeflow.org/v1", "PyTorchJob"): "kubeflow.org_pytorchjobs.yaml",
}
RUNTIME_EXAMPLE = FOLDER / "torch_distributed-runtime.example.yaml"


def read(name: str) -> dict:
    """A YAML file of this folder (the C loader when PyYAML has it: the PyTorchJob CRD is 600 kB)."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return yaml.load((FOLDER / name).read_text(), Loader=loader)


def _closed(node):
    """The schema with additionalProperties: false wherever properties are listed and nothing
    says otherwise (x-kubernetes-preserve-unknown-fields, additionalProperties)."""
    if isinstance(node, list):
        return [_closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _closed(v) for k, v in node.items()}
    if (out.get("type") == "object" and isinstance(out.get("properties"), dict)
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.lru_cache(maxsize=4)
def schema(api_version: str, kind: str) -> dict:
    """The strict JSON schema of a resource, from its CRD's openAPIV3Schema."""
    if (api_version, kind) not in CRDS:
        known = ", ".join(f"{k} ({v})" for v, k in CRDS)
        raise KeyError(f"no schema for {kind} {api_version}; known: {known}")
    crd = read(CRDS[api_version, kind])
    version = api_version.rsplit("/", 1)[-1]
    found = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return _closed(found[0]["schema"]["openAPIV3Schema"])


@functools.lru_cache(maxsize=4)
def _validator(api_version: str, kind: str):
    import jsonschema

    return jsonschema.Draft7Validator(schema(api_version, kind))


def validate(manifest: dict) -> list[str]:
    """One line per problem (`kind spec.a.b: what is wrong`); [] when the manifest fits."""
    if not isinstance(manifest, dict):
        return [f"manifest: {type(manifest).__name__} is not allowed; expected a mapping"]
    key = (manifest.get("apiVersion"), manifest.get("kind"))
    if key not in CRDS:
        allowed = ", ".join(f"{v} {k}" for v, k in CRDS)
        return [f"manifest: apiVersion/kind {key[0]!r} {key[1]!r} is not allowed; expected {allowed}"]
    errors = sorted(_validator(*key).iter_errors(manifest), key=lambda e: list(map(str, e.path)))
    lines = [f"{key[1]} {'.'.join(map(str, e.path)) or '(top)'}: {e.message}" for e in errors]
    name = (manifest.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not _dns_label(name):
        lines.insert(0, f"{key[1]} metadata.name: {name!r} is not allowed; expected lowercase "
                        "letters, digits and '-', starting with a letter, at most 63 characters")
    return lines


def _dns_label(name: str) -> bool:
    return re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name) is not None
