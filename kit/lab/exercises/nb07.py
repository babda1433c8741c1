"""Notebook 07's exercises. Hands-on: what a process of a run does with the variables torchrun
gives it, written as functions of those variables and checked on every process of two layouts
(07.1: its rank, the world, its GPU, whether it is the one that writes; 07.2, stretch: the
samples it trains on, against torch's own DistributedSampler in a child process). Then which file
of the run folder says how a run ended (07.3, from the kit's run-folder layout)."""

from __future__ import annotations

from functools import cache

from kit.lab.exercises import Exercise, one_of


def exit_file() -> str:
    from kit.folder.layout import RunFolder

    return RunFolder.EXIT_CODE


# ---- hands-on: a process's place, from torchrun's variables ----

LAYOUTS = ((1, 2), (2, 4))  # (nodes, processes per node) the functions are called on
SAMPLES = (16, 10)  # data sets of this many samples: 10 does not split evenly over 4 or 8


def torchrun_env(nodes: int, per_node: int, node: int, local: int) -> dict[str, str]:
    """The variables torchrun sets in one process (strings, as os.environ holds them): the
    primer prints them for a real run, notebook 10 for two nodes."""
    return {"RANK": str(node * per_node + local), "LOCAL_RANK": str(local),
            "WORLD_SIZE": str(nodes * per_node), "LOCAL_WORLD_SIZE": str(per_node),
            "GROUP_RANK": str(node), "MASTER_ADDR": "node-0", "MASTER_PORT": "29500"}


def every_process():
    for nodes, per_node in LAYOUTS:
        for node in range(nodes):
            for local in range(per_node):
                yield (nodes, per_node), torchrun_env(nodes, per_node, node, local)


def placement(env):
    """What this process is: its rank among all, how many there are, its GPU, and whether it is
    the one that prints, writes metrics and saves."""
    rank, local = int(env["RANK"]), int(env["LOCAL_RANK"])
    return {"rank": rank, "world_size": int(env["WORLD_SIZE"]), "device": f"cuda:{local}",
            "is_main": rank == 0}


def my_samples(env, samples):
    """The samples this process trains on, as torch's DistributedSampler (shuffle=False) hands
    them: every WORLD_SIZE-th from its RANK, after padding the list with its first samples to a
    multiple of the world size, so that every process takes as many."""
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    per_rank = -(-samples // world)
    padded = list(range(samples)) * 2
    return padded[: per_rank * world][rank::world]


def _device_from_rank(env):
    return {**placement(env), "device": f"cuda:{env['RANK']}"}


def _world_per_node(env):
    return {**placement(env), "world_size": int(env["LOCAL_WORLD_SIZE"])}


def _main_per_node(env):
    return {**placement(env), "is_main": env["LOCAL_RANK"] == "0"}


def _samples_by_local_rank(env, samples):
    return my_samples({**env, "RANK": env["LOCAL_RANK"]}, samples)


def _samples_in_blocks(env, samples):
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    per_rank = -(-samples // world)
    return list(range(samples))[rank * per_rank:(rank + 1) * per_rank]


def _check_placement(fn) -> str | None:
    if not callable(fn):
        return "give the function itself: exercises.check(\"07.1\", placement) (no parentheses)"
    for (nodes, per_node), env in every_process():
        where = (f"on {nodes} node(s) x {per_node}, the process with RANK={env['RANK']}, "
                 f"LOCAL_RANK={env['LOCAL_RANK']}")
        try:
            got = fn(dict(env))
        except Exception as e:  # the learner's code: its error is the hint
            return f"{where}: it raised {type(e).__name__}: {e}"
        want = placement(env)
        if not isinstance(got, dict) or set(got) != set(want):
            return f"return a dict with the keys {sorted(want)}; it returned {got!r}"
        for key in ("rank", "world_size", "device", "is_main"):
            if got[key] == want[key]:
                continue
            if str(got[key]) == str(want[key]):
                return (f"{where}: {key} is {got[key]!r}, a string: torchrun's variables are "
                        f"strings, int() them")
            hint = {"rank": "RANK numbers the processes of every node together",
                    "world_size": "WORLD_SIZE counts every process of the job; LOCAL_WORLD_SIZE "
                                  "those of this node",
                    "device": "GPU indices restart on every node: the GPU comes from LOCAL_RANK",
                    "is_main": "one process of the whole job prints, writes and saves: RANK 0 "
                               "(LOCAL_RANK 0 is one per node, and two writers collide)"}[key]
            return f"{where}: {key} is {got[key]!r}, it should be {want[key]!r}. {hint}"
    return None


@cache
def _samplers() -> dict[tuple[int, int, int], dict[int, list[int]]]:
    """torch's DistributedSampler for every (samples, nodes, per_node) the check asks, by global
    rank (kit.lab.article_checks, all in one child process: this kernel imports no torch)."""
    from kit.run import child

    cases = [[samples, nodes, per_node] for samples in SAMPLES for nodes, per_node in LAYOUTS]
    found = child.call("kit.lab.exercise_ranks:sampler_shares", cases=cases, timeout=300)
    return {tuple(case): {int(rank): share for rank, share in shares["RANK"].items()}
            for case, shares in zip(cases, found, strict=True)}  # fmt: skip


def _sampler(samples: int, nodes: int, per_node: int) -> dict[int, list[int]]:
    return _samplers()[(samples, nodes, per_node)]


def _check_samples(fn) -> str | None:
    if not callable(fn):
        return "give the function itself: exercises.check(\"07.2\", my_samples) (no parentheses)"
    for samples in SAMPLES:
        for (nodes, per_node), env in every_process():
            where = (f"{samples} samples on {nodes} node(s) x {per_node}, RANK={env['RANK']} "
                     f"(LOCAL_RANK={env['LOCAL_RANK']})")
            try:
                got = list(fn(dict(env), samples))
            except Exception as e:  # the learner's code: its error is the hint
                return f"{where}: it raised {type(e).__name__}: {e}"
            want = _sampler(samples, nodes, per_node)[int(env["RANK"])]
            if got == want:
                continue
            if env["RANK"] != env["LOCAL_RANK"] and got == _sampler(samples, nodes, per_node)[
                    int(env["LOCAL_RANK"])]:
                return (f"{where}: {got} are the samples of the process with RANK="
                        f"{env['LOCAL_RANK']} on the first node: by LOCAL_RANK the second node "
                        "trains on the first one's share again (the primer, section 1)")
            if sorted(got) == got and len(got) > 1 and got[1] == got[0] + 1:
                return (f"{where}: {got}, a block; torch's sampler strides: the process of RANK "
                        "r takes r, r + WORLD_SIZE, r + 2 x WORLD_SIZE, ...")
            if samples % (nodes * per_node) and len(got) < len(want):
                return (f"{where}: {got}, {len(got)} samples, torch's sampler {want}: it pads "
                        "the list with its first samples to a multiple of WORLD_SIZE, so every "
                        "process takes as many (and no rank waits for another's last batch)")
            return f"{where}: {got}; torch's DistributedSampler gives {want}"
    return None


EXERCISES = [
    Exercise(
        key="07.1",
        question=("Hands-on, quick: write placement(env), what a process of a run is, from the "
                  "variables torchrun gives it (env: a dict of strings, as os.environ): a dict "
                  "with its rank among all processes, the world size, its GPU ('cuda:N') and "
                  "is_main, whether it is the one process that prints, writes and saves. The "
                  "check calls it for every process of 1 node x 2 and 2 nodes x 4."),
        check=_check_placement,
        solution=lambda: placement,
        wrong=(_device_from_rank, _world_per_node, _main_per_node),
        hands_on=True,
    ),
    Exercise(
        key="07.2",
        question=("Hands-on, stretch: write my_samples(env, samples), the samples (of "
                  "range(samples)) this process trains on, as torch's DistributedSampler "
                  "(shuffle=False) hands them out. The check compares every process of both "
                  "layouts with the real sampler, for 16 samples and for 10."),
        check=_check_samples,
        solution=lambda: my_samples,
        wrong=(_samples_by_local_rank, _samples_in_blocks),
        hands_on=True,
    ),
    Exercise(
        key="07.3",
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
]
