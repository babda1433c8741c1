"""`python -m kit <command>`: the kit's command line.

    python -m kit tour                        # run notebooks/NN-*.ipynb in order, headless
    python -m kit tour -p model kit:llama-1b -p device cuda --only 01 04
    python -m kit strip notebooks/*.ipynb     # clear outputs, except cells tagged keep_output

Add a command: write `_command_<name>(args)` and register its arguments in `_parser`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    tour = commands.add_parser("tour", help="run every notebook in order with papermill")
    tour.add_argument("-p", "--parameter", nargs=2, action="append", default=[],
                      metavar=("NAME", "VALUE"),
                      help="inject a parameter (YAML value) into the notebooks that declare it")  # fmt: skip
    tour.add_argument("--out", default="launch/tour", help="folder for the executed copies")
    tour.add_argument("--only", nargs="*", help="notebook prefixes to run, e.g. 00 03")
    tour.add_argument("--notebooks", default=None, help="folder of notebooks (default: notebooks/)")
    strip = commands.add_parser("strip", help="clear outputs except in cells tagged keep_output")
    strip.add_argument("paths", nargs="+", type=Path)
    return parser


def _command_tour(args) -> int:
    import yaml

    from kit import tour

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
    from kit import tour

    for path in args.paths:
        print(f"{path}: {tour.strip_outputs(path)} cell(s) cleared")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return globals()[f"_command_{args.command}"](args)


if __name__ == "__main__":
    sys.exit(main())
