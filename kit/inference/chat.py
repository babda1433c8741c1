"""Talk to what a run learned: the adapter on its base, through the model's chat template.

    python -m kit chat launch/my-run                       # a REPL: type, read the reply
    python -m kit chat launch/my-run --prompt "Hi" --compare   # one reply, and the base's
    python -m kit chat launch/my-run --prompts qs.txt --out replies.jsonl  # a reply a line

RUN_OR_ADAPTER is a run folder (config.yaml and adapter/) or an adapter folder inside one (a
checkpoint's, e.g. launch/my-run/checkpoints/step-000020/adapter). The base model is found from
the run's config (model.name: a hub id, a local folder or a kit: model), not from the absolute
path in adapter_config.json, so a run folder copied to another machine still chats there.
Replies are greedy (the same reply each time); in the REPL the conversation is kept (a line
`/reset` starts over, an empty line or end of input leaves). `--prompts FILE` asks each line of
FILE (blank lines skipped) on its own, the model loaded once (a `--prompt` a call reloads it:
~30 s each for a real model); `--out FILE` writes one JSON object a prompt, a line each (prompt,
adapter, and base with --compare), as each reply comes.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from kit.config import ConfigError
from kit.folder.layout import RunFolder
from kit.inputs import model_folder


def locate(target: str | Path) -> tuple[Path, Path]:
    """(run folder, adapter folder) for a run folder or an adapter folder inside one."""
    path, folder = Path(target), RunFolder(target)
    if folder.config.is_file() and folder.adapter.is_dir():
        return path, folder.adapter
    if (path / "adapter_config.json").is_file():
        run = next((up for up in path.parents if RunFolder(up).config.is_file()), None)
        if run is None:
            raise ConfigError(f"RUN_OR_ADAPTER: {str(path)!r} is an adapter outside any run folder; "
                              "give the run folder (it names the base model in config.yaml)")
        return run, path
    raise ConfigError(f"RUN_OR_ADAPTER: {str(path)!r} is not a run folder ({RunFolder.CONFIG} and "
                      f"{RunFolder.ADAPTER}/) nor an adapter folder (adapter_config.json)")


def reply(model, tokenizer, messages: list[dict], max_new_tokens: int = 128,
          streamer=None) -> str:  # fmt: skip
    """The model's greedy reply to a conversation (the chat template's generation prompt)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    enc = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                         streamer=streamer)  # fmt: skip
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def replies(model, tokenizer, prompt: str, compare: bool = False,
            max_new_tokens: int = 128) -> dict[str, str]:  # fmt: skip
    """{"adapter": reply} to one user prompt, and {"base": reply} beside it with compare."""
    asked = [{"role": "user", "content": prompt}]
    found = {"adapter": reply(model, tokenizer, asked, max_new_tokens)}
    if compare:
        with model.disable_adapter():
            found["base"] = reply(model, tokenizer, asked, max_new_tokens)
    return found


def read_prompts(path: str | Path) -> list[str]:
    """The non-blank lines of a prompts file; a file that cannot be read, or holds none, is one
    line naming it."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ConfigError(f"--prompts: {str(path)!r} cannot be read ({why}); expected a text "
                          "file, one question a line") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"--prompts: {str(path)!r} holds no prompt; expected one question a line")
    return prompts


def ask_each(model, tokenizer, prompts: list[str], compare: bool = False,
             max_new_tokens: int = 128, out: str | Path | None = None,
             say=print) -> list[dict]:  # fmt: skip
    """`replies` to each prompt with the one loaded model: printed as they come (a reply's
    newlines as \\n, so that each stays one line) and, with `out`, one JSON object a line there,
    flushed a line at a time (an interrupted run keeps what was answered)."""
    import json

    found = []
    with open(out, "w", encoding="utf-8") if out else contextlib.nullcontext() as f:
        for i, prompt in enumerate(prompts, 1):
            said = replies(model, tokenizer, prompt, compare, max_new_tokens)
            found.append({"prompt": prompt, **said})
            say(f"[{i}/{len(prompts)}] {prompt}")
            for name, text in said.items():
                say(f"{name}: " + text.replace("\n", "\\n"))
            if f:
                f.write(json.dumps(found[-1], ensure_ascii=False) + "\n")
                f.flush()
    return found


def _repl(model, tokenizer, max_new_tokens: int, read=input, out=sys.stdout) -> None:
    from transformers import TextStreamer

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    messages: list[dict] = []
    while True:
        try:
            line = read("you> ").strip()
        except EOFError:
            return
        if not line:
            return
        if line == "/reset":
            messages = []
            continue
        messages.append({"role": "user", "content": line})
        out.write("model> ")
        out.flush()
        messages.append({"role": "assistant",
                         "content": reply(model, tokenizer, messages, max_new_tokens, streamer)})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kit chat", description=__doc__.splitlines()[0])
    parser.add_argument("target", metavar="RUN_OR_ADAPTER",
                        help="a run folder (launch/<run>) or an adapter folder inside one")
    asked = parser.add_mutually_exclusive_group()
    asked.add_argument("--prompt", help="one question: print the reply and exit (no REPL)")
    asked.add_argument("--prompts", metavar="FILE", help="a question a line: a reply to each, "
                       "the model loaded once")
    parser.add_argument("--compare", action="store_true", help="with --prompt or --prompts: the "
                        "base model's reply too (the adapter switched off)")
    parser.add_argument("--out", metavar="FILE", help="with --prompts: the replies as JSON Lines, "
                        "one object a prompt (prompt, adapter, base)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    if args.out and not args.prompts:
        parser.error("--out: only with --prompts FILE")
    import warnings

    from transformers.utils import logging as hf_logging

    from kit.folder.manifest import CheckpointError
    from kit.inference.merge import load_for_inference

    # A terminal tool: no weight-loading bar, and no library's notice of its own renamings
    # (transformers' is_gradient_checkpointing, as PEFT calls it), which the user cannot act on.
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)

    try:
        prompts = read_prompts(args.prompts) if args.prompts else None  # before the model loads
        if args.out and not Path(args.out).absolute().parent.is_dir():
            raise ConfigError(f"--out: {args.out!r}: its folder does not exist")
        run, adapter = locate(args.target)
        model_folder.check_adapter(adapter)  # a damaged file named, before the base loads
        model, tokenizer = load_for_inference(run, adapter)
    except (ConfigError, CheckpointError) as e:
        print(f"chat: {e}", file=sys.stderr)
        return 2
    if prompts is not None:
        try:
            ask_each(model, tokenizer, prompts, args.compare, args.max_new_tokens, args.out)
        except OSError as e:  # --out cannot be written
            print(f"chat: --out: {args.out!r} cannot be written ({e.strerror or e})", file=sys.stderr)
            return 2
        return 0
    if args.prompt is None:
        _repl(model, tokenizer, args.max_new_tokens)
        return 0
    for name, said in replies(model, tokenizer, args.prompt, args.compare,
                              args.max_new_tokens).items():  # fmt: skip
        print(f"{name}: {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
