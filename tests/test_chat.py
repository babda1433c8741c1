"""python -m kit chat: a run's adapter answers through the chat template, from any copy of the run."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from conftest import ROOT

from kit.config import ConfigError
from kit.inference import chat


def kit_chat(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kit", "chat", *map(str, args)], cwd=ROOT,
                          input=stdin, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_chat_answers_from_a_run_copied_elsewhere_as_it_does_in_process(tiny_run, tmp_path):
    """The run folder copied to another place (another machine's): its config names the base
    model, so the adapter still loads; --compare gives the base's reply beside it; a checkpoint's
    adapter folder works as the run folder does; the replies are those of kit.inference.chat.replies."""
    from kit.inference.merge import load_for_inference

    moved = tmp_path / "elsewhere" / "run"
    shutil.copytree(tiny_run, moved)
    proc = kit_chat(moved, "--prompt", "Add 2 and 3.", "--compare", "--max-new-tokens", "6")
    assert proc.returncode == 0 and proc.stderr.strip() == "", proc.stderr
    said = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert list(said) == ["adapter", "base"]
    model, tokenizer = load_for_inference(moved)
    assert chat.replies(model, tokenizer, "Add 2 and 3.", True, 6) == said
    step = next((moved / "checkpoints").iterdir()) / "adapter"
    assert kit_chat(step, "--prompt", "Add 2 and 3.", "--max-new-tokens", "6").returncode == 0


@pytest.mark.slow
def test_chat_repl_keeps_the_conversation_until_an_empty_line(tiny_run):
    proc = kit_chat(tiny_run, "--max-new-tokens", "4", stdin="Hello.\n/reset\nAdd 2 and 3.\n\nnot read\n")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("you> ") == 4 and proc.stdout.count("model> ") == 2, proc.stdout


def test_chat_names_what_it_cannot_chat_with(tmp_path):
    with pytest.raises(ConfigError, match="is not a run folder"):
        chat.locate(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="is an adapter outside any run folder"):
        chat.locate(tmp_path)
    proc = kit_chat(tmp_path / "nothing")
    assert proc.returncode == 2 and proc.stderr.startswith("chat: RUN_OR_ADAPTER:")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_chat_prompts_file_loads_the_model_once_and_replies_a_line_each(tiny_run, tmp_path,
                                                                        monkeypatch, capsys):
    """`kit chat RUN --prompts FILE --compare --out FILE`: the base and adapter loaded once for
    every prompt (the issue's 20 prompts took ~10 minutes as 20 --prompt calls, each reloading);
    one JSON line a prompt (blank lines skipped) holding kit.inference.chat.replies' answers; a
    reply printed a line each. A missing prompts file is one line, before any model loads."""
    import json

    from kit.inference import merge

    loads = []
    real = merge.load_for_inference
    monkeypatch.setattr(merge, "load_for_inference",
                        lambda *a, **k: loads.append(a) or real(*a, **k))
    asked = ["Add 2 and 3.", "Capital of Peru?", "Say hi."]
    prompts, out = tmp_path / "prompts.txt", tmp_path / "replies.jsonl"
    prompts.write_text(f"{asked[0]}\n\n{asked[1]}\n  {asked[2]}  \n")
    args = [str(tiny_run), "--prompts", str(prompts), "--compare", "--out", str(out),
            "--max-new-tokens", "4"]
    assert chat.main(args) == 0 and len(loads) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    model, tokenizer = real(tiny_run)
    assert rows == [{"prompt": p, **chat.replies(model, tokenizer, p, True, 4)} for p in asked]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"[1/3] {asked[0]}" and len(printed) == 3 * 3
    assert printed[1] == "adapter: " + rows[0]["adapter"].replace("\n", "\\n")
    assert chat.main([str(tiny_run), "--prompts", str(tmp_path / "none.txt")]) == 2
    assert len(loads) == 1 and capsys.readouterr().err.startswith("chat: --prompts: ")
