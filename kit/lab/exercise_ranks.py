"""The hands-on exercises' code on ranks: a learner's function, sent as source text, run by every
process of a real gloo group, and what each rank got back (rank side; the checks in
kit/lab/exercises/ call these through kit.run.child, so a notebook's kernel imports no torch).

    child.call("kit.lab.exercise_ranks:collective", source=SOURCE, name="all_reduce_by_parts",
               lengths=[4, 8])    # [{"rank": 0, "length": 4, "output": [...], "error": ""}, ...]
    child.call("kit.lab.exercise_ranks:wrap_step", source=SOURCE, name="wrap")  # notebook 04
    child.call("kit.lab.exercise_ranks:wrap_steps", cases=[[SOURCE, "wrap"], ...])  # several at once
    child.call("kit.lab.exercise_ranks:order_cases", cases=[["fixed", SOURCE]])  # notebook 05
    child.call("kit.lab.exercise_ranks:sampler_shares", cases=[[16, 2, 4]])  # notebook 07

The ranks are forked from the child process (torch imported once, before the fork; no operation
has run yet, so no thread pool is copied) and meet through a FileStore in a temporary folder. A
collective that one rank never joins times out after `timeout_s`, and a rank that hangs anyway is
killed: a wrong answer is a hint, never a notebook that waits for good.
"""

from __future__ import annotations

import multiprocessing
import re
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist


def first_line(e: BaseException) -> str:
    """`Type: first line`, without the `[rank0]:[F1129 ... File.cpp:1537] ` prefix gloo's checks
    put before their message."""
    text = re.sub(r"\[rank\d+\]:(\[[^\]]*\])?\s*", "", str(e)).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def learner_function(source: str, name: str, namespace: dict | None = None):
    """The function `name` defined by `source` (the learner's cell), with torch, dist and
    `namespace` already there, as the exercise promised."""
    scope = {"torch": torch, "dist": dist, "__name__": "exercise", **(namespace or {})}
    exec(compile(source, f"<your {name}>", "exec"), scope)  # the learner's own code, in their process
    if not callable(scope.get(name)):
        raise NameError(f"the code defines no function named {name}")
    return scope[name]


def inputs(rank: int, length: int) -> torch.Tensor:
    """What rank `rank` holds: 1, 2, 3, ... scaled by 10 ** rank (rank 1: 10, 20, 30, ...), so a
    sum, a slice or one rank's own values are told apart at a glance."""
    return torch.arange(1, length + 1, dtype=torch.float32) * 10**rank


def _rank(rank: int, world: int, store_path: str, source: str, name: str, lengths: list[int],
          timeout_s: float, pipe) -> None:  # fmt: skip
    rows = []
    try:
        store = dist.FileStore(store_path, world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))  # fmt: skip
        fn = learner_function(source, name)
        for length in lengths:
            t = inputs(rank, length)
            row = {"rank": rank, "length": length, "input": t.tolist(), "output": None,
                   "error": "", "input_after": None}  # fmt: skip
            try:
                got = fn(t)
                row["input_after"] = t.tolist()
                if isinstance(got, torch.Tensor):
                    row["output"] = got.detach().flatten().tolist()
                    row["shape"] = list(got.shape)
                elif got is not None:
                    row["error"] = f"returned a {type(got).__name__}, not a tensor"
            except Exception as e:  # the learner's mistake: a row, not a crash
                row["error"] = first_line(e)
                rows.append(row)
                break  # the ranks may now disagree on what comes next
            rows.append(row)
    except Exception as e:
        rows.append({"rank": rank, "length": None, "output": None, "error": first_line(e),
                     "trace": traceback.format_exc(limit=3)})  # fmt: skip
    finally:
        pipe.send(rows)
        pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def collective(source: str, name: str, lengths: list[int], world: int = 2,
               timeout_s: float = 10.0) -> list[dict]:
    """Run `name(t)` from `source` on every rank of a gloo group of `world` processes, once per
    length (rank r's t: inputs(r, length)); one row per rank and length: its input, what the
    function returned (flattened) or the first line of what it raised. A rank that has not
    answered `timeout_s` + 20 s after the start is killed; its row says so."""
    return _on_ranks(_rank, (source, name, lengths, timeout_s), world, timeout_s)


def collectives(cases: list, world: int = 2, timeout_s: float = 10.0) -> list[list[dict]]:
    """collective() for each of `cases` ([source, name, lengths] each), in turn, from this one
    process: torch is imported once for all of them."""
    return [collective(source, name, lengths, world, timeout_s) for source, name, lengths in cases]


class Toy(torch.nn.Module):
    """A decoder in miniature for notebook 04's wrap: embeddings, `layers` blocks (a linear layer
    and an activation each, the units a wrap policy would pick) and a head."""

    def __init__(self, layers: int = 4, width: int = 32, vocab: int = 64):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
            for _ in range(layers))  # fmt: skip
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def _wrap_rank(rank: int, world: int, store_path: str, source: str, name: str, layers: int,
               timeout_s: float, pipe) -> None:  # fmt: skip
    """One training step of Toy, wrapped by the learner's `name(model, mesh)`, inside the
    notebook's own instruments (kit.lab.sharding.Timeline and Collectives)."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from kit.lab.sharding import Collectives, Timeline

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # Toy's head returns a view
    row = {"rank": rank, "error": ""}
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                                world_size=world, timeout=timedelta(seconds=timeout_s))  # fmt: skip
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(0)
        model = Toy(layers)
        fn = learner_function(source, name, {"fully_shard": fully_shard})
        try:
            wrapped = fn(model, mesh)
        except Exception as e:  # the learner's mistake: a row, not a crash
            row["error"] = first_line(e)
            return
        wrapped = model if wrapped is None else wrapped
        row["sharded"] = {n: isinstance(p, DTensor) for n, p in model.named_parameters()}
        ids = torch.arange(2 * 8).reshape(2, 8) % 64
        timeline = Timeline(wrapped)
        with Collectives() as counts, timeline:
            loss = wrapped(ids).float().pow(2).mean()
            timeline.mark("backward")
            loss.backward()
        row.update(units=timeline.units, timeline=timeline.segments(), collectives=counts)
    except Exception as e:
        row["error"] = first_line(e)
    finally:
        pipe.send([row])
        pipe.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def wrap_step(source: str, name: str, layers: int = 4, world: int = 2,
              timeout_s: float = 10.0) -> list[dict]:
    """Toy(layers) wrapped by `name(model, mesh)` from `source` on every rank of a gloo group, one
    forward and backward measured: per rank, the units, the timeline's segments, the collectives,
    which parameters are sharded (DTensors), or the first line of the error."""
    import torch._dynamo  # what fully_shard's first call imports: 2 s, once here, not per rank
    import torch.distributed.device_mesh
    import torch.distributed.fsdp
    import torch.distributed.tensor  # noqa: F401

    import kit.lab.sharding  # noqa: F401

    return _on_ranks(_wrap_rank, (source, name, layers, timeout_s), world, timeout_s)


def wrap_steps(cases: list, layers: int = 4, world: int = 2,
               timeout_s: float = 10.0) -> list[list[dict]]:
    """wrap_step() for each of `cases` ([source, name] each), in turn, from this one process."""
    return [wrap_step(source, name, layers, world, timeout_s) for source, name in cases]


def order_cases(cases: list, steps: int = 3) -> dict:
    """Notebook 05: the learner's cases, [name, source] each, beside recipe_order, each run as the
    notebook's cases run (kit.lab.order_rank.Trial: the tiny Llama in NF4, LoRA, FSDP2, AdamW
    steps), here on a gloo group of one in this process. {"recipe_order": what its Trial
    measured, "cases": the same for each case, in order}, each with ok and the first line of an
    error. A case sees order_rank's names (torch, trainable, enable_activation_checkpointing),
    as the notebook's cases do."""
    import gc

    from kit.config import load_config
    from kit.lab import order_rank
    from kit.recipe import dist as kdist

    env = kdist.init("cpu")
    cfg = load_config("tiny-cpu", ["training.device=cpu", f"training.steps={steps}"])

    def run(make) -> dict:
        trial = order_rank.Trial(cfg, env, "fsdp2", "nf4", {})
        torch.manual_seed(cfg.training.seed)
        try:
            make()(trial)
            return {"ok": True, "error": "", **trial.notes}
        except Exception as e:  # the learner's mistake: what it measured, and the error
            return {"ok": False, "error": first_line(e), **trial.notes}
        finally:
            gc.collect()

    try:
        return {"recipe_order": run(lambda: order_rank.recipe_order),
                "cases": [run(lambda n=name, src=source: learner_function(src, n, vars(order_rank)))
                          for name, source in cases]}  # fmt: skip
    finally:
        kdist.cleanup()


def sampler_shares(cases: list) -> list[dict]:
    """Notebook 07: torch's DistributedSampler shares (kit.lab.article_checks.sampler_shares) for
    each of `cases` ([samples, nodes, per_node] each), from this one process."""
    from kit.lab.article_checks import sampler_shares as shares

    return [shares(samples, nodes, per_node) for samples, nodes, per_node in cases]


def _on_ranks(target, args: tuple, world: int, timeout_s: float) -> list[dict]:
    """Fork `world` processes that run target(rank, world, store, *args, pipe); their rows."""
    ctx = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        pipes, procs = [], []
        for rank in range(world):
            ours, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(rank, world, store, *args, theirs),
                               daemon=True)  # fmt: skip
            proc.start()
            theirs.close()
            pipes.append(ours)
            procs.append(proc)
        rows = []
        for rank, (pipe, proc) in enumerate(zip(pipes, procs, strict=True)):
            if pipe.poll(timeout_s + 20):
                rows += pipe.recv()
            else:
                rows.append({"rank": rank, "length": None, "output": None,
                             "error": f"no answer after {timeout_s + 20:.0f} s: killed"})  # fmt: skip
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return rows
