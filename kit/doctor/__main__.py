"""python -m kit.doctor: the doctor from a terminal; exit code 1 when any finding is an error.

python -m kit.doctor CONFIG.yaml [key=value ...]
python -m kit.doctor --script train.py
python -m kit.doctor --run launch/<run>
python -m kit.doctor --explain launch/<run>/run.log     ('-': read stdin)
"""

from __future__ import annotations

import sys
from pathlib import Path

from kit.doctor.explain import explain
from kit.doctor.preflight import preflight
from kit.doctor.run import diagnose_run
from kit.doctor.script import scan_script
from kit.findings import Finding, errors, ordered


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="kit doctor", description=__doc__.split("\n")[0]
    )
    parser.add_argument("config", nargs="?", help="kit or accelerate YAML config")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    parser.add_argument("--script", help="scan a training script for known pitfalls")
    parser.add_argument("--run", help="diagnose a run folder (metrics, result, adapter, logs)")
    parser.add_argument("--explain", help="explain the errors in a log file ('-': stdin)")
    args = parser.parse_intermixed_args(argv)
    findings: list[Finding] = []
    if args.config:
        findings += preflight(args.config, overrides=args.overrides)
    if args.script:
        findings += scan_script(Path(args.script).read_text())
    if args.run:
        findings += diagnose_run(args.run)
    if args.explain:
        text = sys.stdin.read() if args.explain == "-" else Path(args.explain).read_text()
        findings += explain(text)
    if not (args.config or args.script or args.run or args.explain):
        parser.print_help()
        return 2
    for f in ordered(findings):
        print(f)
    n = len(errors(findings))
    print(f"{n} error(s), {len(findings) - n} other finding(s)")
    return 1 if n else 0


if __name__ == "__main__":
    sys.exit(main())
