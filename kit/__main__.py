"""`kit <command>` (or `python -m kit <command>`): the kit's one command line.

    kit train tiny-cpu training.steps=20 --nproc 2    # check once, write launch/<run>/, train, follow
    kit check my.yaml data.path=rows.jsonl          # the check alone: one line, or what is wrong
    kit plan my.yaml --gpus 1 --gpu-mem 24 --gpu H100   # the planner's choices, nothing started
    kit doctor my.yaml                              # known pitfalls for this config and machine
    kit bench benchmarks/matrices/bench-tiny.yaml --out launch/bench   # recipes side by side
    kit merge launch/my-run launch/my-run/merged    # the adapter folded into the base, exported
    kit checkpoints list launch/my-run              # also: checkpoints verify PATH
    kit chat launch/my-run --prompt "Hi" --compare  # a run's adapter answers (and its base)
    kit chat launch/my-run --prompts qs.txt --out replies.jsonl   # a reply a line, loaded once
    kit runs                                        # runs under launch/; runs NAME --follow | --stop
    kit jobs tiny-cpu --nnodes 2 --nproc-per-node 8 --out launch/big   # every way to launch; runs nothing
    kit models                                      # the built-in kit: models, built or not
    kit models path kit:smollm2-135m-instruct       # builds it if needed, prints its folder
    kit tour                                        # every notebook in order, headless
    kit tour -p model kit:llama-1b -p device cuda --only 01 04
    kit strip notebooks/*.ipynb                     # clear outputs, except cells tagged keep_output
    kit keep notebooks/03-lora-adapters.ipynb launch/tour/03-lora-adapters.ipynb

`kit <command> -h` explains each. Mistakes that can be known before a process starts are one line
on stderr and exit code 2. Add a command: write `_command_<name>(args)` and register its
arguments in `_parser`, or name a module with its own `main(argv)` in PASS_THROUGH.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Commands whose module parses its own arguments (`kit <command> -h` is theirs): module, the
# words put before the command's own, help.
PASS_THROUGH = {
    "train": ("kit.run.door", [], "check a config once, write its run folder, train under torchrun, "
              "follow the output (kit train -h)"),
    "check": ("kit.run.check", [], "the check step alone: config, model, data rows, this machine, "
              "the run folder; one line on success (kit check -h)"),
    "plan": ("kit.run.plan", [], "what the planner chooses for a config on this machine or on "
             "stated GPUs: each value, who chose it and why, the step's and the run's time "
             "(kit plan -h)"),
    "doctor": ("kit.doctor.__main__", [], "known QLoRA + FSDP pitfalls of a config, a script or a "
               "run folder (kit doctor -h)"),
    "bench": ("kit.bench.runner", [], "a matrix of training configurations, side by side, in one "
              "invocation (kit bench -h)"),
    "merge": ("kit.inference.merge", ["merge"], "a run's adapter folded into its base and exported "
              "(kit merge -h)"),
    "checkpoints": ("kit.inference.merge", [], "a run's checkpoints listed, an adapter or checkpoint "
                    "verified (kit checkpoints -h)"),
    "chat": ("kit.inference.chat", [], "talk to a run's adapter on its base model (kit chat -h)"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kit", description=__doc__.splitlines()[0],
                                     epilog="kit <command> -h explains each command.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    for name, (_, _, what) in PASS_THROUGH.items():
        commands.add_parser(name, add_help=False, help=what).add_argument(
            "rest", nargs=argparse.REMAINDER)
    tour = commands.add_parser("tour", help="run every notebook in order with papermill")
    tour.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                      metavar=("NAME", "VALUE"),
                      help="inject a parameter (YAML value) into the notebooks that declare it")  # fmt: skip
    tour.add_argument("--out", default="launch/tour", help="folder for the executed copies")
    tour.add_argument("--only", nargs="*", help="notebook prefixes to run, e.g. 00 03")
    tour.add_argument("--notebooks", default=None, help="folder of notebooks (default: notebooks/)")
    strip = commands.add_parser("strip", help="clear outputs except in cells tagged keep_output")
    strip.add_argument("paths", nargs="+", type=Path)
    keep = commands.add_parser("keep", help="record the checked outputs (cells tagged "
                               "keep_output) of an executed copy in the committed notebook")
    keep.add_argument("notebook", type=Path, help="the committed notebook")
    keep.add_argument("executed", type=Path, help="its executed copy (e.g. from launch/tour/)")
    jobs = commands.add_parser(
        "jobs", help="write every way to launch a config on N nodes x M GPUs (run.sh, "
        "accelerate.yaml, job.sbatch, trainjob.yaml, pytorchjob.yaml); runs nothing")
    jobs.add_argument("config", help="a kit YAML, or a bundled config's name (tiny-cpu)")
    jobs.add_argument("overrides", nargs="*", help="key=value, e.g. training.steps=200")
    jobs.add_argument("--nnodes", default="1", help="nodes (default 1)")
    jobs.add_argument("--nproc-per-node", default="8", help="processes (GPUs) per node (default 8)")
    jobs.add_argument("--out", help="the folder (default: the config's run folder, launch/<run.name>)")
    jobs.add_argument("--image", help="the container image of the Kubernetes manifests "
                      "(default: a placeholder, registry.example.com/kit:latest)")
    jobs.add_argument("--pvc", help="the PersistentVolumeClaim holding the checkout, data and "
                      "outputs (default: kit-workspace)")
    jobs.add_argument("--time", help="Slurm's time limit (default 01:00:00)")
    runs = commands.add_parser("runs", help="the runs under launch/ (status, last step); NAME "
                               "--follow follows one, NAME --stop stops it")
    runs.add_argument("name", nargs="?", help="a run's name (launch/NAME) or its folder")
    what = runs.add_mutually_exclusive_group()
    what.add_argument("--follow", action="store_true", help="print its output until it ends "
                      "(Ctrl-C leaves it running)")
    what.add_argument("--stop", action="store_true", help="a stop request: the ranks save a "
                      "checkpoint of their step and exit; whatever is left 30 s later is killed")
    models = commands.add_parser("models", help="list the built-in kit: models (shape, built or "
                                 "not, folder); 'models path NAME' builds one and prints its folder")
    models_of = models.add_subparsers(dest="action")
    models_of.add_parser("path", help="build NAME if needed; print its folder").add_argument(
        "name", help="a built-in model, e.g. kit:smollm2-135m-instruct")
    return parser


def _command_tour(args) -> int:
    import yaml

    from kit.run import tour

    parameters = {name: yaml.safe_load(value) for name, value in args.parameter}
    folder = Path(args.notebooks) if args.notebooks else tour.NOTEBOOKS
    try:
        outcomes = tour.tour(Path(args.out), parameters, args.only, folder)
    except ValueError as e:
        print(f"tour: {e}", file=sys.stderr)
        return 2
    failed = [o for o in outcomes if not o.ok]
    total = sum(o.seconds for o in outcomes)
    print(f"{len(outcomes) - len(failed)}/{len(outcomes)} notebooks ran in {total:.0f}s")
    return 1 if failed or not outcomes else 0


def _command_strip(args) -> int:
    from kit.run import tour

    for path in args.paths:
        print(f"{path}: {tour.strip_outputs(path)} cell(s) cleared")
    return 0


def _command_keep(args) -> int:
    from kit.run import tour

    print(f"{args.notebook}: {tour.keep_outputs(args.notebook, args.executed)} checked cell(s) recorded")
    return 0


def _command_jobs(args) -> int:
    from kit.config import ConfigError
    from kit.run import jobs

    given = {k: getattr(args, k) for k in ("image", "pvc", "time") if getattr(args, k) is not None}
    try:
        folder = jobs.write(args.config, args.overrides, nnodes=args.nnodes,
                            nproc_per_node=args.nproc_per_node, out=args.out, **given)
    except ConfigError as e:
        for line in str(e).splitlines():
            print(f"jobs: {line}", file=sys.stderr)
        return 2
    print(f"{folder}: {args.nnodes} node(s) x {args.nproc_per_node} processes, nothing started")
    for file, how in jobs.USES.items():
        print(f"  {file:16} {how.format(folder=folder)}")
    return 0


def _command_runs(args) -> int:
    import time

    from kit.run.runs import Follow, Run, runs

    if args.name is None:
        for run in runs():
            print(f"{run.name:<28} {run.status:<10} step {run.last_step():>6}  {run.folder}")
        return 0
    try:
        run = Run.attach(args.name)
    except FileNotFoundError as e:
        print(f"runs: {e}", file=sys.stderr)
        return 2
    if args.stop:
        print(f"kit: run {run.name!r} {run.stop()}: {run.folder}")
        return 0
    if args.follow:
        log = Follow(run.files.log)
        try:
            while run.status == "running":
                for line in log.new_lines():
                    print(line, flush=True)
                time.sleep(0.2)
        except KeyboardInterrupt:  # a detached run is stopped by --stop alone
            print(f"kit: no longer following; run {run.name!r} goes on: kit runs "
                  f"{args.name} --stop stops it")
            return 130
        for line in log.new_lines():
            print(line)
    print(f"kit: run {run.name!r} {run.status}: {run.folder}")
    return (run.exit_code or 0) if args.follow else 0


def _command_models(args) -> int:
    from kit.budget import shapes
    from kit.inputs import builtin

    if args.action == "path":
        key = args.name.removeprefix(builtin.PREFIX)
        if key not in builtin.SPECS:
            allowed = ", ".join(builtin.PREFIX + k for k in builtin.SPECS)
            print(f"models path: NAME {args.name!r} is not a built-in model; allowed: {allowed}",
                  file=sys.stderr)
            return 2
        print(builtin.build(key))
        return 0
    print(f"{'name':<27} {'architecture':<12} {'weights':<10} {'layers':>6} {'hidden':>6} "
          f"{'params':>8}  {'built':<5}  folder")
    for key, spec in builtin.SPECS.items():
        shape, folder = shapes.shape_of(spec), builtin.folder(key)
        weights = ("pretrained" if key in builtin.CONVERTED
                   else "at load" if key in builtin.AT_LOAD else "random")  # fmt: skip
        built = "yes" if (folder / "config.json").is_file() else "no"
        print(f"{builtin.PREFIX + key:<27} {spec['model_type']:<12} {weights:<10} "
              f"{shape.layers:>6} {shape.hidden:>6} {shape.params / 1e6:>7.1f}M  {built:<5}  {folder}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in PASS_THROUGH:  # its own parser, -h included (REMAINDER drops -h)
        import importlib

        module, words, _ = PASS_THROUGH[argv[0]]
        return importlib.import_module(module).main([*words, *argv[1:]])
    parser = _parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv[:1] == ["jobs"]:  # options between its key=value words too
        args = commands.choices["jobs"].parse_intermixed_args(argv[1:])
        args.command = "jobs"
    else:
        args = parser.parse_args(argv)  # no command, or a wrong one: argparse says which exist
    return globals()[f"_command_{args.command}"](args)


if __name__ == "__main__":
    sys.exit(main())
