"""What every notebook does first, in one line: `from kit.lab.course import begin; begin()`."""

from __future__ import annotations

import os
import warnings
from pathlib import Path


def begin() -> None:
    """Work from the repository root (runs land in its launch/, whatever folder the kernel or
    papermill's --cwd started in) and quiet library noise: transformers' weight-loading bars and
    the renames transformers and peft announce (FutureWarning). Tables show their cells whole:
    a case's error message is the lesson, not something to cut at 50 characters."""
    import pandas as pd

    here = Path.cwd()
    root = next((p for p in (here, *here.parents) if (p / "kit" / "__init__.py").is_file()), None)
    if root is None:  # an installed kit, a notebook copied elsewhere: the package's own checkout
        root = Path(__file__).resolve().parents[2]
    os.chdir(root)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    pd.set_option("display.max_colwidth", None)
