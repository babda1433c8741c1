"""Talk to what a run learned: the adapter on its base, through the model's chat template.

    python -m kit chat launch/my-run                       # a REPL: type, read the reply
    python -m kit chat launch/my-run --prompt "Hi" --compare   # one reply, and the base's

RUN_OR_ADAPTER is a run folder (config.yaml and adapter/) or an adapter folder inside one (a
checkpoint's, e.g. launch/my-run/checkpoints/step-000020/adapter). The base model is found from
the run's config (model.name: a hub id, a local folder or a kit: model), not from the absolute
path in adapter_config.json, so a run folder copied to another machine still chats there.
Replies are greedy (the same reply each time); in the REPL the conversation is kept (a line
`/reset` starts over, an empty line or end of input leaves).
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--prompt", help="one question: print the reply and exit (no REPL)")
    parser.add_argument("--compare", action="store_true",
                        help="with --prompt: the base model's reply too (the adapter switched off)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    import warnings

    from transformers.utils import logging as hf_logging

    from kit.folder.manifest import CheckpointError
    from kit.recipe.merge import load_for_inference

    # A terminal tool: no weight-loading bar, and no library's notice of its own renamings
    # (transformers' is_gradient_checkpointing, as PEFT calls it), which the user cannot act on.
    hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)

    try:
        run, adapter = locate(args.target)
        model_folder.check_adapter(adapter)  # a damaged file named, before the base loads
        model, tokenizer = load_for_inference(run, adapter)
    except (ConfigError, CheckpointError) as e:
        print(f"chat: {e}", file=sys.stderr)
        return 2
    if args.prompt is None:
        _repl(model, tokenizer, args.max_new_tokens)
        return 0
    for name, said in replies(model, tokenizer, args.prompt, args.compare,
                              args.max_new_tokens).items():  # fmt: skip
        print(f"{name}: {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
