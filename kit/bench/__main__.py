"""python -m kit.bench MATRIX ...: the benchmark runner (kit.bench.runner)."""

import sys

from kit.bench.runner import main

if __name__ == "__main__":
    sys.exit(main())
