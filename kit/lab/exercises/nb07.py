"""Notebook 07's exercises: which rank and GPU torchrun's variables give a process, which file of
the run folder says how a run ended, and the dtype FSDP2 computes the adapters in (answers from
the kit's run-folder layout and config: no torchrun)."""

from __future__ import annotations

from kit.lab.exercises import Exercise, one_of


def rank_and_gpu() -> tuple[int, int]:
    """run.sh on NNODES=2 nodes of NPROC=4: torchrun numbers the processes node by node (RANK =
    NODE_RANK x nproc_per_node + LOCAL_RANK), and the kit puts each on GPU LOCAL_RANK
    (kit.recipe.dist.init: torch.device("cuda", local_rank)): GPU indices restart on every node."""
    nproc_per_node, node_rank, local_rank = 4, 1, 2
    return node_rank * nproc_per_node + local_rank, local_rank  # the device: cuda:<local_rank>


def exit_file() -> str:
    from kit.folder.layout import RunFolder

    return RunFolder.EXIT_CODE


def fsdp2_compute_dtype() -> str:
    """What FSDP2's MixedPrecisionPolicy gathers the fp32 LoRA shards as, for the notebook's config
    (kit.recipe.engines.FSDP2.wrap: param_dtype is model.dtype when mixed precision is on)."""
    from kit.config import load_config
    from kit.recipe.quantize import DTYPES

    cfg = load_config("tiny-cpu")
    dtype = DTYPES[cfg.model.dtype] if cfg.sharding.mixed_precision else DTYPES["float32"]
    return str(dtype).removeprefix("torch.")


def check_dtype(answer) -> str | None:
    name = str(answer).removeprefix("torch.").strip().lower()
    name = {"bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}.get(name, name)
    if name == fsdp2_compute_dtype():
        return None
    if name == "float32":
        return "float32 is how FSDP2 stores the LoRA shard, and what DDP computes with; what does it gather?"
    return "read the mixed-precision bullets of notebook 04, section 7, and the config's model.dtype"


EXERCISES = [
    Exercise(
        key="07.1",
        question=("run.sh on 2 nodes with 4 GPUs each (NNODES=2, nproc 4): on the node with "
                  "NODE_RANK=1, the process torchrun gives LOCAL_RANK=2. Which RANK does it get, "
                  "and which GPU index does the kit put it on? Answer a tuple (rank, gpu)."),
        check=one_of(rank_and_gpu(), hints={
            (2, 2): "RANK numbers the processes of every node together; LOCAL_RANK restarts per node",
            (6, 6): "a node has GPUs 0 to 3: the device comes from LOCAL_RANK, not RANK",
            (5, 1): "ranks and GPU indices count from 0",
        }, default="RANK = NODE_RANK x processes per node + LOCAL_RANK; the GPU: cuda:LOCAL_RANK"),
        solution=rank_and_gpu,
        wrong=((2, 2), (6, 6), (5, 1)),
    ),
    Exercise(
        key="07.2",
        question=("A kernel restarted while a run went on. Which file of launch/<run>/ says how "
                  "the whole process tree ended, whether it finished, crashed or was stopped? "
                  "Its name, a string."),
        check=one_of(exit_file(), hints={
            "result.json": "the recipe's summary, written by rank 0 at the end of training: a run "
                           "that crashed or was killed may never write it",
            "run.log": "the log says what happened, in words; one file holds only the status",
            "pid": "pid says which process tree is the run while it runs, not how it ended",
        }, default="look at what Run.attach reads: section 3's text names the files"),
        solution=exit_file,
        wrong=("result.json", "run.log", "pid"),
    ),
    Exercise(
        key="07.3",
        question=("FSDP2 and DDP losses differ in the last digits. In which dtype does FSDP2 compute "
                  "with the LoRA weights in this notebook's runs (DDP uses float32)? A dtype name."),
        check=check_dtype,
        solution=fsdp2_compute_dtype,
        wrong=("float32", "float16"),
    ),
]
