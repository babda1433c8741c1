"""How a value is written into a generated file, one function per language the kit writes.

    shell_word("/runs/a b")        # "'/runs/a b'": one bash word, nothing in it expands
    comment("x\\ny")                # 'x\\\\ny': stays on its comment line, whatever it holds
    yaml_scalar("a: b")            # "'a: b'": yaml.safe_load reads back the same string
    yaml_document(tree)            # a whole YAML file from a tree (yaml's own dumper)
    sbatch_value("/r/%x", "run.output_dir", pattern=True)   # '/r/%%x' for an #SBATCH line

run.sh (kit.run.launch), job.sbatch, accelerate.yaml and the Kubeflow manifests (kit.run.jobs)
take every value that comes from a config, an option or a path through these; the config
loader (kit.config) already refuses control characters in any string field, so that a value
cannot reach a generated file as a line of its own even where a generator forgets.
"""

from __future__ import annotations

import re
import shlex
import unicodedata

import yaml

from kit.config import ConfigError

# Characters that end or break a line for some reader of the kit's files: bash ends a comment at
# \n; YAML breaks lines at \r, \x85, \u2028 and \u2029; a NUL ends a C string (Slurm's parser).
_BREAKS = {"Cc", "Zl", "Zp"}


def control_chars(value: str) -> list[str]:
    """The control and line-break characters in value (unicode categories Cc, Zl, Zp)."""
    return [c for c in value if unicodedata.category(c) in _BREAKS]


def shell_word(value) -> str:
    """value as exactly one bash word: nothing in it is expanded, split or run."""
    return shlex.quote(str(value))


def comment(value) -> str:
    """value for the inside of a `#` comment line (shell or YAML): control characters and line
    breaks are written as escapes, so the text cannot start a line of its own."""
    return "".join(c.encode("unicode_escape").decode("ascii")
                   if unicodedata.category(c) in _BREAKS else c for c in str(value))


def yaml_scalar(value) -> str:
    """value as one YAML flow scalar (quoted where YAML would read it otherwise), one line."""
    text = yaml.safe_dump(value, default_flow_style=True, width=float("inf"),
                          allow_unicode=False, default_style='"' if _multiline(value) else None)
    return text.removesuffix("\n...\n").rstrip("\n")


def _multiline(value) -> bool:
    return isinstance(value, str) and bool(control_chars(value))


def yaml_document(tree) -> str:
    """A whole YAML file: yaml's own dumper quotes every value that needs it."""
    return yaml.safe_dump(tree, sort_keys=False)


# Slurm reads an #SBATCH line's value up to whitespace and strips quotes itself; a backslash in
# a file name turns its %-patterns off. None of these can be escaped there, so they are refused.
_SBATCH_BAD = re.compile(r"""[\s'"\\]""")


def sbatch_value(value, field: str, pattern: bool = False) -> str:
    """value for an `#SBATCH --option=value` line; pattern: a file name option (--output),
    where Slurm expands %-patterns, so a literal % is doubled. Raises ConfigError naming field
    for a value Slurm cannot read back as it is."""
    text = str(value)
    if _SBATCH_BAD.search(text) or control_chars(text):
        raise ConfigError(f"{field}: {text!r} is not allowed; expected no whitespace, quotes or "
                          "backslashes (Slurm's #SBATCH line names it)")
    return text.replace("%", "%%") if pattern else text
