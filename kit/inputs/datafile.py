"""Data files, read and checked before anything trains: data.path (and data.val_path) resolved,
read by `datasets`, and every row checked, so that a bad file is refused with one line naming
the file, the line or record, the bad value and what is allowed (a ConfigError), not a traceback
and not a row that silently trains on the text "None".

    check_file(cfg.data)                      # the pre-flight and the check step: raises or not
    rows = read_rows(resolve_path(cfg.data.path))
    check_rows(cfg.data.path, rows, cfg.data)
    with read_once():                         # a start, a rank's setup: each file read once

Imports no torch (nor `datasets` at import time): the notebook kernel and the launcher import it
before any process starts; kit.recipe.data (the rank side) tokenizes what it returns.
Longer than 400 lines because every refusal names the file, the row and what is allowed, and the
one read per process (read_once) stays beside the readers it stands in for.
"""

from __future__ import annotations

import contextlib
import difflib
import hashlib
import json
import os
import re
from pathlib import Path

from kit import ROOT
from kit.config import ConfigError, DataConfig
from kit.inputs.builtin import kit_home

BUNDLED = {"kit:sample": "sample.jsonl", "kit:sample-chat": "sample-chat.jsonl"}
PACKED_ROW = 2048  # data.max_seq_len "auto" with packing: tokens per packed row (kit.recipe.data)
BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
SHOWN = 5  # bad rows named in one message beyond the first


def resolve_path(path: str, field: str = "data.path") -> Path:
    """A bundled file, or a local one: relative paths from here, else from the checkout (where
    the ranks run, kit.run.launch)."""
    if path in BUNDLED:
        return Path(__file__).parents[1] / "data" / BUNDLED[path]
    p = Path(path).expanduser()
    if p.suffix not in BUILDERS:
        allowed = ", ".join(list(BUILDERS) + list(BUNDLED))
        raise ConfigError(f"{field}: {path!r} is not allowed; expected a file ending in {allowed}")
    for candidate in (p, ROOT / p):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{field}: {path!r} does not exist")


def shipped(path: str) -> bool:
    """data.path is one of the kit's own files (kit:sample, kit/data/...): a recipe's sample."""
    try:
        return resolve_path(path).resolve().parent == (Path(__file__).parents[1] / "data").resolve()
    except ConfigError:
        return False


class Unreadable(ConfigError):
    """datasets failed on a file whose every line parses: `rows`, read by the standard library,
    may still show which row is bad (e.g. a number where the texts are strings)."""

    def __init__(self, message: str, rows: list[dict]):
        super().__init__(message)
        self.rows = rows


def read_rows(path: Path, field: str = "data.path", name: str = "") -> list[dict]:
    """Rows of a local file, read by `datasets` (the reader for every format). GPU images often
    ship without `datasets` (and its pyarrow): there json/jsonl/csv fall back to the standard
    library, and parquet asks for `datasets`. `name`: the file as the config gives it."""
    where = f"{field}: {name or str(path)!r}"
    try:
        from datasets import load_dataset
    except ImportError:
        return read_rows_stdlib(path, field, name)
    try:
        with _quiet():
            # Its cache under KIT_HOME with the kit's other caches, not ~/.cache/huggingface.
            rows = load_dataset(BUILDERS[path.suffix], data_files=literal(path), split="train",
                                cache_dir=str(kit_home() / "datasets"))
        rows = rows.to_list()
    except Exception as e:  # noqa: BLE001 - any failure of the reader becomes one line below
        # This fills a gap: datasets' error names no line (and an empty file ends in a bare
        # StopIteration), so the standard library reads the file again to find the bad one.
        readable = read_rows_stdlib(path, field, name) if path.suffix != ".parquet" else []
        cause = e
        while cause.__cause__ or cause.__context__:
            cause = cause.__cause__ or cause.__context__
        said = str(cause).splitlines()[0] if str(cause) else ""
        raise Unreadable(
            f"{where} cannot be read by datasets ({type(cause).__name__}: {said})", readable
        ) from None
    if not rows:
        raise ConfigError(f"{where} holds no rows")
    return rows


LITERAL = re.compile(r"[\w/. +-]*")  # what datasets reads as written: no glob, $, :, ~ or %


def literal(path: Path) -> str:
    """`path` as datasets will read it literally. datasets takes data_files as a glob pattern
    ('rows [v2].jsonl' matches rows v.jsonl or rows 2.jsonl, not itself) after os.path.expandvars
    ('$HOME' in a file name becomes /root), with no way to escape either; a name outside LITERAL
    is read through a symlink of a plain name under $KIT_HOME/datasets/files."""
    text = str(path.resolve())
    if LITERAL.fullmatch(text):
        return text
    link = kit_home() / "datasets" / "files" / (
        hashlib.sha1(text.encode("utf-8", "surrogateescape")).hexdigest()[:16] + path.suffix)
    if not (link.is_symlink() and os.readlink(link) == text):
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp = link.with_name(f"{link.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        os.symlink(text, tmp)
        os.replace(tmp, link)  # atomic: ranks reading side by side see one link or the other
    return str(link)


def read_text(path: Path, where: str) -> str:
    """A data file's text, or one line naming the file, the line and the column of its first
    byte that is not UTF-8 (Python's error names neither file nor line)."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ConfigError(f"{where} line {line}: not UTF-8 (byte 0x{data[e.start]:02x} at column "
                          f"{column})") from None


@contextlib.contextmanager
def _quiet():
    """datasets without its progress bars and its own error log while it reads: a bad file is
    the one line below, not three (each rank used to print "Generating train split" too)."""
    from datasets.utils import logging as datasets_logging

    bars, level = datasets_logging.is_progress_bar_enabled(), datasets_logging.get_verbosity()
    datasets_logging.disable_progress_bar()
    datasets_logging.set_verbosity(datasets_logging.CRITICAL)
    try:
        yield
    finally:
        if bars:
            datasets_logging.enable_progress_bar()
        datasets_logging.set_verbosity(level)


def read_rows_stdlib(path: Path, field: str = "data.path", name: str = "") -> list[dict]:
    """The fallback reader (fills the gap where `datasets` is not installed), and the one that
    names the bad line when `datasets` fails: an unparsable line is a ConfigError."""
    where = f"{field}: {name or str(path)!r}"
    if path.suffix == ".parquet":
        raise ConfigError(f"{where} needs the datasets package (pip install datasets)")
    text = read_text(path, where)
    rows = _csv_rows(text, where) if path.suffix == ".csv" else _json_rows(path, text, where)
    if not rows:
        raise ConfigError(f"{where} holds no rows")
    return rows


def _csv_rows(text: str, where: str) -> list[dict]:
    import csv

    reader = csv.reader(text.splitlines(keepends=True), strict=True)
    rows, header, start = [], None, 1
    try:
        for record in reader:
            if header is None:
                header = record
            elif len(record) > len(header):  # what datasets' reader (pandas) refuses
                raise ConfigError(f"{where} line {start} does not parse as CSV ({len(record)} "
                                  f"fields; the header has {len(header)})")
            elif record:
                missing = [None] * (len(header) - len(record))  # as csv.DictReader fills them
                rows.append(dict(zip(header, record + missing, strict=True)))
            start = reader.line_num + 1
    except csv.Error as e:
        raise ConfigError(f"{where} line {start} does not parse as CSV ({e})") from None
    return rows


def _json_rows(path: Path, text: str, where: str) -> list[dict]:
    """A .json file: one JSON document (a list of records), or JSON Lines as .jsonl holds."""
    if path.suffix == ".json" and text.strip():
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            if e.msg != "Extra data":  # "Extra data": several documents, read as JSON Lines
                raise ConfigError(f"{where} line {e.lineno} is not valid JSON "
                                  f"({e.msg}: column {e.colno})") from None
        else:
            records = data if isinstance(data, list) else [data]
            for i, r in enumerate(records, 1):
                if not isinstance(r, dict):
                    raise ConfigError(f"{where} record {i} is {_short(r)}, not a JSON object")
            return records
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} line {number} is not valid JSON "
                              f"({e.msg}: column {e.colno})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{where} line {number} is {_short(row)}, not a JSON object")
        rows.append(row)
    return rows


def columns_of(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in rows for k in r))


# Chat roles a row may use; ShareGPT-style rows ({"from", "value"} in a `conversations` column,
# the other common layout) are read as messages with their roles mapped to these.
ROLES = ("system", "user", "assistant", "tool")
SHAREGPT = "conversations"
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant",
                  "assistant": "assistant", "tool": "tool", "observation": "tool"}


def as_messages(value) -> list:
    """A row's chat as {role, content} messages; ShareGPT's {from, value} turns mapped (a role
    it does not know is kept as written, for the check to name)."""
    if not isinstance(value, list):
        return value
    return [{"role": SHAREGPT_ROLES.get(m["from"], m["from"]), "content": m["value"]}
            if isinstance(m, dict) and "from" in m and "value" in m else m for m in value]


def texts_column(rows: list[dict], cfg: DataConfig, name: str,
                 field: str = "data.path") -> tuple[str, str]:
    """(format, column) the texts come from: data.format (auto: messages if that column exists,
    or a ShareGPT `conversations` column, read as messages) and its field, which must be a column
    of the file `name` (`field`); chat rows in a CSV, whose cells are strings, are refused."""
    columns = columns_of(rows)
    fmt = cfg.format
    sharegpt = cfg.messages_field not in columns and SHAREGPT in columns
    if fmt == "auto":
        fmt = "messages" if cfg.messages_field in columns or sharegpt else "text"
    column = (SHAREGPT if sharegpt else cfg.messages_field) if fmt == "messages" else cfg.text_field
    if fmt == "messages" and str(name).endswith(".csv"):
        raise ConfigError(
            f"{field}: {name!r} is a CSV file with chat rows ({column!r}); a CSV holds text rows "
            f"only (a string column, data.text_field, data.format=text): chat rows (messages, "
            f"ShareGPT conversations) need a .jsonl, .json or .parquet file")
    if column not in columns:
        field = "data.messages_field" if fmt == "messages" else "data.text_field"
        raise ConfigError(f"{field}: {column!r} is not a column of {name}; columns: "
                          f"{', '.join(columns)}" + ("; prompt/completion rows are not read: write "
                          "each as messages, the prompt the user's turn and the completion the "
                          "assistant's" if {"prompt", "completion"} <= set(columns) else ""))
    return fmt, column


def check_rows(name: str, rows: list[dict], cfg: DataConfig, field: str = "data.path") -> None:
    """Every row holds a text (a string) or chat messages (a non-empty list of {role, content});
    otherwise one line naming the first bad row and the numbers of the others (refuse_rows)."""
    where = f"{field}: {name!r}"
    if not rows:
        raise ConfigError(f"{where} holds no rows")
    fmt, column = texts_column(rows, cfg, name, field)
    trains = fmt == "messages" and cfg.train_on == "assistant"
    bad = [(i, p) for i, r in enumerate(rows) if (p := _problem(r.get(column), fmt, trains))]
    allowed = (
        "a string in data.text_field" if fmt == "text"
        else "a non-empty list of {role, content} messages in data.messages_field"
        + (", one of them the assistant's (data.train_on=all trains every token)" if trains
           else "")
    )
    refuse_rows(name, field, column, bad, f"every row needs {allowed}")


def refuse_rows(name: str, field: str, column: str, bad: list[tuple[int, str]],
                allowed: str) -> None:
    """Raise one line naming the first bad row (index i, its problem) and the numbers of the
    others: a .jsonl file's rows are numbered by line (blank lines count: datasets skips them),
    the others' by record (from 1, a CSV's header not counted). Nothing bad: nothing raised."""
    if not bad:
        return
    if str(name).endswith(".jsonl") or name in BUNDLED:
        path = resolve_path(name, field)
        text = read_text(path, f"{field}: {name!r}")
        lines = [n for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        number, which = (lambda i: lines[i] if i < len(lines) else i + 1), "line {}"
    else:
        header = ", the header not counted" if str(name).endswith(".csv") else ""
        number, which = (lambda i: i + 1), "record {}" + header
    (first, problem), rest = bad[0], bad[1:]
    more = ""
    if rest:
        shown = ", ".join(str(number(i)) for i, _ in rest[:SHOWN])
        shown += ", ..." if len(rest) > SHOWN else ""
        more = f" ({len(rest)} more bad row{'s' if len(rest) > 1 else ''}: {shown})"
    at = number(first)
    raise ConfigError(f"{field}: {name!r} row {at} ({which.format(at)}): {column!r} {problem}"
                      f"{more}; {allowed}")


def render_chats(rows: list[dict], cfg: DataConfig, tokenizer, name: str,
                 field: str = "data.path") -> list[str]:
    """Each chat row as the model's chat template renders it, checked against the template: a row
    the template refuses (a role it raises on, turns out of the order it wants) or renders
    without one of its messages (templates that know no such role drop it, silently) is refused
    in one line naming the row, the message and its role. Needs no torch: the tokenizer is given."""
    from jinja2 import TemplateError

    column = texts_column(rows, cfg, name, field)[1]
    texts, bad = [], []
    for i, row in enumerate(rows):
        chat = as_messages(row[column])
        try:
            text = tokenizer.apply_chat_template(chat, tokenize=False)
        except TemplateError as e:
            bad.append((i, f"is refused by the model's chat template: {str(e).splitlines()[0]}"))
            texts.append("")
            continue
        lost = [(k, m["role"]) for k, m in enumerate(chat, 1)
                if isinstance(m["content"], str) and m["content"].strip() not in text]
        if lost:
            k, role = lost[0]
            bad.append((i, f"message {k} (role {role!r}) is not in the text the model's chat "
                           "template makes of it"))
        texts.append(text)
    refuse_rows(name, field, column, bad, "allowed: roles and turns this model's chat template "
                "renders (data.format=text trains on a text column as written)")
    return texts


def _problem(value, fmt: str, assistant: bool = False) -> str:
    """What is wrong with one row's value ("" when nothing is). assistant: a chat must have an
    assistant's turn with something in it (the loss covers only those turns: without one the
    row trains nothing, and a batch of such rows has a loss of 0/0, NaN, at step 1)."""
    if value is None:
        return "is missing or null"
    if fmt == "text":
        return "" if isinstance(value, str) else f"is {_short(value)}, not a string"
    if not isinstance(value, list) or not value:
        return f"is {_short(value)}, not a non-empty list"
    for i, m in enumerate(as_messages(value), 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m.get("content") is None:
            return f"message {i} is {_short(m)}, not a {{role, content}} dict"
        if m["role"] not in ROLES:
            near = difflib.get_close_matches(m["role"], ROLES, n=1, cutoff=0.6)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            return (f"message {i} has the role {m['role']!r}{hint}, not one of "
                    f"{', '.join(ROLES)}")
    if assistant and not any(m["role"] == "assistant" and str(m["content"]).strip()
                             for m in as_messages(value)):
        return "has no assistant message with content: nothing in it trains"
    return ""


def _short(value, limit: int = 60) -> str:
    """A value as one short line: its repr (cut) and its type."""
    text = repr(value)
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{text} ({type(value).__name__})"


def split_sizes(rows: int, val_fraction: float) -> tuple[int, int]:
    """(training rows, validation rows) of a file of `rows` rows with no data.val_path: the one
    rule the check, kit.recipe.data and kit.sft.trainer split by. val_fraction > 0: round(rows x
    fraction) rows held out, at least one; 0: every row trains and the first 64 also evaluate."""
    if val_fraction <= 0:
        return rows, min(64, rows)
    held = max(1, round(rows * val_fraction))
    return rows - held, held


_ONCE: list[dict] = []  # read_once's scopes (the innermost last): rows by the file's path


@contextlib.contextmanager
def read_once(stdlib: bool = False):
    """Within it each file is read once in this process, by one reader (stdlib: as the check
    step reads, else as the ranks do), however many steps check, plan or split its rows."""
    _ONCE.append({"stdlib": stdlib})
    try:
        yield
    finally:
        _ONCE.pop()


def read_checked(path: str, cfg: DataConfig, field: str = "data.path",
                 stdlib: bool = False) -> list[dict]:
    """The rows of data.path (or data.val_path: `field`), every one checked. stdlib: read
    json/jsonl/csv with the standard library (the check step: no second of importing datasets
    before every start; the ranks read with datasets); within `read_once`, as it says."""
    resolved, held = resolve_path(path, field), _ONCE[-1] if _ONCE else {}
    try:
        if resolved in held:
            rows = held[resolved]
        elif held.get("stdlib", stdlib) and resolved.suffix != ".parquet":
            rows = held[resolved] = read_rows_stdlib(resolved, field, path)
        else:
            rows = held[resolved] = read_rows(resolved, field, path)
    except Unreadable as e:
        if e.rows:
            check_rows(path, e.rows, cfg, field)  # names the bad row, when a row is bad
        raise
    check_rows(path, rows, cfg, field)
    return rows


def check_file(cfg: DataConfig, stdlib: bool = False) -> None:
    """Read data.path and data.val_path and check every row: a ConfigError (one line) or None."""
    read_checked(cfg.path, cfg, stdlib=stdlib)
    if cfg.val_path:
        read_checked(cfg.val_path, cfg, "data.val_path", stdlib=stdlib)
