"""A benchmark matrix file, read and checked: what the runner (kit.bench), its ranks
(kit.bench.worker) and notebook 09 read the same way.

    m = load_matrix("benchmarks/matrices/bench-tiny.yaml")   # a bad value: ValueError, one line
    case_nproc(m, m["cases"][2])                              # the processes a case runs on

Both sides import it: no torch, no launcher.
"""

from __future__ import annotations

from pathlib import Path

import yaml

# article: kit.bench.article; peer: kit.bench.peer (the peer stack); unsloth: kit.bench.unsloth;
# kit: kit.train.Recipe.
RECIPES = ("article", "kit", "peer", "unsloth")


def load_matrix(path: str | Path, to_run: bool = True) -> dict:
    """The matrix as a dict, every scaling case filled in from the case it scales; a bad value
    raises ValueError in one line naming the case and field. `to_run=False` reads a record's
    matrix as it ran: lengths past the model's positions, refused since, are kept as history."""
    m = yaml.safe_load(Path(path).read_text())
    names = [c["name"] for c in m["cases"]]
    if len(set(names)) != len(names):
        raise ValueError(f"cases: names must be unique, got {names}")
    # A scaling case is another case's setup on its own number of processes: it takes that
    # case's recipe, options, overrides, cap and batches, and no part in the per-cap comparison.
    by_name = {c["name"]: c for c in m["cases"]}
    for i, c in enumerate(m["cases"]):
        if "scales" in c:
            if c["scales"] not in by_name or "scales" in by_name[c["scales"]]:
                raise ValueError(f"cases.{c['name']}.scales: {c['scales']!r} is not allowed; "
                                 "expected the name of a case that scales no other, one of "
                                 f"{[n for n, b in by_name.items() if 'scales' not in b]}")
            base = {k: v for k, v in by_name[c["scales"]].items()
                    if k in ("recipe", "options", "overrides", "cap_gib", "batches", "seed")}
            m["cases"][i] = {**base, "role": "scaling", **c}
    data = m.get("equivalence", {}).get("data")
    if data not in (None, "sample"):
        raise ValueError(f"equivalence.data: {data!r} is not allowed; expected 'sample' (the "
                         "bundled sample text, for a real model) or nothing (synthetic tokens)")
    for c in m["cases"]:
        if c.get("recipe") not in RECIPES:
            raise ValueError(f"cases.{c['name']}.recipe: {c.get('recipe')!r} is not allowed; "
                             "expected 'article', 'kit', 'peer' or 'unsloth'")
        batches = c.get("batches")
        # "auto": the batch the kit's recipe plans for itself during setup (the worker reads
        # training.batch_size after it); the baselines have no planner.
        if isinstance(batches, list) and "auto" in batches:
            if batches != ["auto"]:
                raise ValueError(f"cases.{c['name']}.batches: {batches!r} is not allowed; "
                                 "expected ['auto'] alone or whole numbers in ascending order")
            if c["recipe"] != "kit":
                raise ValueError(f"cases.{c['name']}.batches: ['auto'] is not allowed for recipe "
                                 f"{c['recipe']!r}; expected whole numbers in ascending order "
                                 "(only the kit's recipe plans its own batch)")
        seqs = c.get("seq_lens")
        if seqs is not None and not (isinstance(seqs, list) and seqs and seqs == sorted(set(seqs))
                                     and all(isinstance(q, int) and q > 0 for q in seqs)):
            raise ValueError(f"cases.{c['name']}.seq_lens: {seqs!r} is not allowed; expected "
                             "positive whole numbers in ascending order (a context sweep)")
        if seqs is not None and batches == ["auto"] and seqs != [m.get("seq_len")]:
            # The plan is made in the case's setup, for the matrix's seq_len: a sweep to other
            # lengths would train at a batch planned for another length.
            raise ValueError(f"cases.{c['name']}.seq_lens: {seqs!r} is not allowed with batches "
                             f"['auto']; expected [{m.get('seq_len')}] (the matrix's seq_len, "
                             "which the plan is made for)")
        n = c.get("nproc", 1)
        if not (isinstance(n, int) and not isinstance(n, bool) and n > 0):
            raise ValueError(f"cases.{c['name']}.nproc: {n!r} is not allowed; expected a "
                             "positive whole number (processes: one per GPU)")
    if to_run:
        _within_positions(m)
    return m


def _within_positions(m: dict) -> None:
    """The longest length a matrix trains (its seq_len, every case's seq_lens) is at most the
    model's max_position_embeddings, as the recipe refuses longer rows (kit.recipe.model): a
    length sweep would otherwise train past what the model was built for."""
    from kit.inputs import sources

    most = (sources.model_config(str(m.get("model", ""))) or {}).get("max_position_embeddings")
    if not most:
        return
    for c in m["cases"]:
        longest = max([m.get("seq_len") or 0, *(c.get("seq_lens") or [])])
        if longest > most:
            field = f"cases.{c['name']}.seq_lens" if longest in (c.get("seq_lens") or []) \
                else "seq_len"
            raise ValueError(f"{field}: {longest} is not allowed; expected at most {most} ("
                             f"{m['model']} has max_position_embeddings={most})")


def no_cuda_gpu(device, stack: str) -> str | None:
    """One line saying why `stack` (a baseline whose kernels need a CUDA GPU) cannot run on
    `device` (a torch.device, or the matrix's training.device: "cuda", "cpu", "auto"), None when
    a CUDA GPU is there. The kernel side asks with the matrix's device (a string) and imports no
    torch: a machine without nvidia-smi has no CUDA GPU for it. A rank asks with its
    torch.device, on the GPU."""
    import shutil

    kind = getattr(device, "type", str(device)).split(":")[0]
    if kind == "cpu":
        return f"{stack}; this matrix runs on cpu"
    if kind not in ("cuda", "auto"):
        return f"{stack}; device {kind!r} is not cuda"
    if isinstance(device, str) and shutil.which("nvidia-smi") is None:
        return f"{stack}; no CUDA GPU here (no nvidia-smi)"
    return None


def case_nproc(matrix: dict, case: dict) -> int:
    """The processes (GPUs) a case runs on: its own `nproc` (a scaling case: the same setup on
    another number of GPUs), else the matrix's."""
    return case.get("nproc", matrix.get("nproc", 2))
