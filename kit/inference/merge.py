"""Reading back what was trained, outside training: load the base exactly as trained plus the
adapter in one process (no FSDP), export a merged standalone model, generate greedily; and the
command line `kit checkpoints {list,verify,merge}` (also `kit merge RUN OUT`, with `--gguf` a GGUF
file next to OUT: kit.inference.gguf_export), where every failure is one line on stderr and exit
code 2. What verifies a saved adapter or checkpoint is the recipe's own (kit.recipe.verify), as
the recipe checks each save with it.

The kit never deletes a user's files: a merge into a folder that exists is refused, and the export
is written into a temporary folder of its own next to it, renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from kit.folder import manifest
from kit.folder.layout import RunFolder
from kit.folder.manifest import MARKER, CheckpointError, first_line
from kit.recipe.verify import saved_shapes, verify_adapter, verify_checkpoint


def load_for_inference(run_dir, adapter: str | Path | None = None, merged: bool = False):
    """(model, tokenizer) of a finished run in one process, no FSDP: the base exactly as trained
    (quantized per the run's config) plus the adapter. `adapter`: another adapter folder (e.g. a
    checkpoint's); `merged`: fold the adapter in (see merge_adapter)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kit.config import load_config
    from kit.inputs import builtin
    from kit.recipe import quantize

    cfg = load_config(RunFolder(run_dir).config)
    adapter = Path(adapter or RunFolder(run_dir).adapter)
    base = builtin.resolve(cfg.model.name)
    if builtin.init_at_load(base) is not None:  # random weights made at load, never written
        raise CheckpointError(f"model.name: {cfg.model.name} has no weights on disk (its weights "
                              "are initialised at each load); nothing to load the adapter onto")
    model = AutoModelForCausalLM.from_pretrained(
        base,
        dtype=quantize.DTYPES[cfg.model.dtype],
        quantization_config=quantize.bnb_config(cfg),
        **({"device_map": {"": 0}} if torch.cuda.is_available() else {}),
    )
    if merged and cfg.quantization.method != "none":
        # bf16 Linear layers holding exactly the 4-bit values the adapter was trained against.
        model = model.dequantize()
    if cfg.quantization.method != "none":  # a mixture of experts: its stacks as trained, dense
        from kit.recipe import experts

        experts.round_trip(model, quantize.params4bit_kwargs(cfg))
    try:
        model = PeftModel.from_pretrained(model, adapter)
    except Exception as e:  # safetensors' or PEFT's error on a damaged adapter: name the folder
        raise CheckpointError(f"{adapter}: cannot be loaded onto {cfg.model.name} "
                              f"({first_line(e)})") from e
    if merged:
        model = model.merge_and_unload()
    return model.eval(), AutoTokenizer.from_pretrained(adapter)


def merge_adapter(run_dir, out_dir, adapter: str | Path | None = None) -> Path:
    """Fold a run's adapter into its base weights (dequantized to model.dtype) and export a
    standalone model with save_pretrained into `out_dir`, a folder that must not exist yet:
    loadable by plain AutoModelForCausalLM, no PEFT."""
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise CheckpointError(f"out: '{out_dir}' exists; choose a new folder")
    model, tokenizer = load_for_inference(run_dir, adapter, merged=True)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        if "quantization_config" in config or not list(tmp.glob("*.safetensors")):
            raise CheckpointError(f"{out_dir}: merged export is still quantized or holds no weights")
        if out_dir.exists():  # appeared while merging
            raise CheckpointError(f"out: '{out_dir}' exists; choose a new folder")
        manifest.ordinary_modes(tmp)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # the temporary folder made above, nothing else
    return out_dir


def fresh_folder(path: str | Path) -> Path:
    """`path` if nothing is there yet, else the first of path-2, path-3, ... that is free: a place
    to merge into without touching an earlier export."""
    path, n = Path(path), 2
    candidate = path
    while candidate.exists():
        candidate, n = path.with_name(f"{path.name}-{n}"), n + 1
    return candidate


@torch.no_grad()
def generate(model, tokenizer, prompt: str, max_new_tokens: int = 24) -> str:
    """Greedy continuation of `prompt` (deterministic, so before/after comparisons are fair)."""
    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


# --------------------------------------------------------------------------- command line


def _verify(path: Path) -> list[str]:
    """One line per thing verified at `path`: an adapter folder, a checkpoint, or a run folder (its
    adapter and every checkpoint). Raises CheckpointError at the first problem."""
    if not path.exists():
        raise CheckpointError(f"verify: '{path}' does not exist")
    if (path / "adapter_config.json").exists() or (path / "adapter_model.safetensors").exists():
        return [f"{path}: {verify_adapter(path, saved_shapes(path))}"]
    if (path / MARKER).exists() or manifest.STEP_FOLDER.fullmatch(path.name):
        return [f"{path}: {verify_checkpoint(path)}"]
    if not RunFolder(path).config.is_file():
        raise CheckpointError(f"verify: '{path}' is no adapter, checkpoint or run folder")
    adapter = RunFolder(path).adapter
    lines = [f"{adapter}: {verify_adapter(adapter, saved_shapes(adapter))}"]
    return lines + [f"{f}: {verify_checkpoint(f)}" for _, f in manifest.step_folders(path)]


def _merge(run: Path, out: Path, adapter: str | None, gguf: str | None = None) -> list[Path]:
    """The merged folder, and with `gguf` (a type: f16, bf16, q8_0) a GGUF file next to it
    (kit.inference.gguf_export); all that can be refused is refused before anything is written."""
    if out.exists():
        raise CheckpointError(f"out: '{out}' exists; choose a new folder")
    if not RunFolder(run).config.is_file():
        raise CheckpointError(f"run: '{run}' " + (
            "has no config.yaml (not a run folder)" if run.is_dir() else "does not exist"))
    if gguf:
        from kit.inference import gguf_export

        gguf_export.check_run(run, gguf_export.gguf_path(out, gguf), gguf)
    folder = Path(adapter) if adapter else RunFolder(run).adapter
    verify_adapter(folder, saved_shapes(folder))
    merged = merge_adapter(run, out, folder)
    if not gguf:
        return [merged]
    return [merged, gguf_export.export(merged, gguf_export.gguf_path(merged, gguf), gguf)]


def main(argv: list[str] | None = None) -> int:
    """kit checkpoints {list,verify,merge} ... (kit merge RUN OUT [--gguf [--type T]]: merge).
    A failure: one line on stderr, exit 2."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="kit checkpoints", description=main.__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="checkpoints of a run, complete and incomplete").add_argument("run")
    sub.add_parser("verify", help="an adapter folder, a checkpoint, or a run's "
                   "adapter and checkpoints").add_argument("path")
    m = sub.add_parser("merge", help="fold the adapter into the base; export with save_pretrained")
    m.add_argument("run")
    m.add_argument("out", help="a folder that does not exist yet")
    m.add_argument("--adapter", default=None)
    m.add_argument("--gguf", action="store_true", help="also write OUT-<type>.gguf next to OUT, "
                   "for llama.cpp, Ollama, LM Studio (Llama, Mistral, Qwen2, Qwen3)")
    m.add_argument("--type", default=None, help="the GGUF's weights: f16 (default), bf16, q8_0")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            if not Path(args.run).is_dir():
                raise CheckpointError(f"run: '{args.run}' does not exist")
            rows = manifest.summary(args.run)
            for row in rows:
                print(row if row["complete"] else f"{row['folder']}: " + (
                    "SET ASIDE (never resumed)" if row.get("set_aside") else "INCOMPLETE (never resumed)"))
            if not rows:
                print(f"{manifest.checkpoints_root(args.run)}: no checkpoints")
        elif args.command == "verify":
            print("\n".join(_verify(Path(args.path))))
        else:
            if args.type and not args.gguf:
                raise CheckpointError(f"--type: {args.type} given without --gguf "
                                      "(it is the GGUF's type)")
            kind = (args.type or "f16") if args.gguf else None
            print("\n".join(map(str, _merge(Path(args.run), Path(args.out), args.adapter, kind))))
    except CheckpointError as e:
        print(f"{parser.prog} {args.command}: {e}", file=sys.stderr)
        return 2
    return 0
