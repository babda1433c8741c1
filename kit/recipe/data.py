"""Training data: a local json/jsonl/csv/parquet file (or the bundled sample), read through
`datasets` and every row checked by kit.inputs.datafile, plain text or chat messages, tokenized
once (kit.recipe.tokens) to fixed-length rows and split across ranks.

    split = Split(cfg.data, tokenizer, seed)   # read, checked, rendered, split, tokenized once
    split.longest()                            # data.max_seq_len=auto (kit.recipe.planning)
    train, val = split.rows(512)               # the rows at the planned length

With data.packing, several samples share a row (kit.recipe.tokens.encode_packed): rows carry
`position_ids` that restart at 0 per sample and no `attention_mask`, which is how transformers
recognises packed rows
(masking_utils.find_packed_sequence_indices: a block-diagonal causal mask for sdpa/eager/flex;
flash_attention_2 reads the boundaries from position_ids, but only in a batch of one row, hence
`loader(one_row=True)`). The model must run without a KV cache (config.use_cache=False), or
transformers ignores the packing and attention crosses samples.

Notebook 12 reads back what a fine-tune taught: `packed_mask` (a packed row's mask), `chat_replies`
(greedy replies through the chat template) and `score` (the form answer-format.jsonl teaches)."""

from __future__ import annotations

import copy
import re

import torch
from torch.utils.data import DataLoader, DistributedSampler, default_collate

from kit.config import AUTO, ConfigError, DataConfig

# Files are read and checked in kit.inputs.datafile (no torch).
from kit.inputs.datafile import (
    PACKED_ROW,
    as_messages,
    check_file,
    read_checked,
    render_chats,
    split_sizes,
    texts_column,
)
from kit.recipe import tokens


def warm_cache(cfg: DataConfig) -> None:
    """Read (and check) the files, so that `datasets` has cached them: one rank first (within
    kit.inputs.datafile.read_once, the rows the split reads afterwards)."""
    check_file(cfg)


def _chats(rows: list[dict], cfg: DataConfig, tokenizer, name: str, field: str = "data.path"):
    """(texts, spans): each row's text (chat rows rendered by the chat template, each row checked
    against it: kit.inputs.datafile.render_chats) and, where only the assistant's turns train (chat
    rows, data.train_on=assistant), their character spans in it; spans None: every token trains."""
    fmt, column = texts_column(rows, cfg, name, field)
    if fmt == "text":
        return [r[column] for r in rows], None
    if not tokenizer.chat_template:
        raise ConfigError("data.format: 'messages' needs a tokenizer with a chat template")
    texts = render_chats(rows, cfg, tokenizer, name, field)
    if cfg.train_on == "all":
        return texts, None
    if not tokenizer.is_fast:  # the spans become labels through the fast tokenizers' offsets
        raise ConfigError(f"data.train_on: 'assistant' needs a fast tokenizer (character offsets); "
                          f"{type(tokenizer).__name__} is not one; allowed: data.train_on=all")
    chats = [as_messages(r[column]) for r in rows]
    return texts, [assistant_spans(m, t, tokenizer) for m, t in zip(chats, texts, strict=True)]


def assistant_spans(messages: list[dict], text: str, tokenizer) -> list[tuple[int, int]]:
    """Where the assistant's turns stand in `text` (the chat rendered whole), as character spans:
    each turn is what the template adds between the prompt that asks for it
    (add_generation_prompt=True) and the chat that ends with it, its end-of-turn mark included.
    This fills a gap: transformers' return_assistant_tokens_mask works only with templates that
    mark turns with {% generation %}, which few models ship (SmolLM2's does not)."""
    spans = []
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:k], tokenize=False,
                                               add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ConfigError(
                "data.train_on: 'assistant' is not allowed with this tokenizer: its chat template "
                "does not render a chat as its first turns followed by the rest; use "
                "data.train_on=all")
        spans.append((len(before), len(through)))
    if spans and messages[-1]["role"] == "assistant":  # the end-of-sequence token after the
        spans[-1] = (spans[-1][0], len(text) + len(tokenizer.eos_token or ""))  # last reply
    return spans


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real (non-padding) tokens of a batch. Packed rows have no attention mask: every token before
    a row's last sample start is real (samples are packed end to end), and the last sample ends at
    its last labelled token (the end-of-sequence token of a text, or of the last reply of a chat
    when only the assistant's turns train; a last sample with no label at all counts its first
    token only). The padding tail after it has no label and no sample start."""
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    positions, labels = batch["position_ids"], batch["labels"]
    index = torch.arange(positions.shape[-1], device=positions.device).expand_as(positions)
    last_start = torch.where(positions == 0, index, -1).amax(dim=-1)
    last_label = torch.where(labels != -100, index, -1).amax(dim=-1)
    return int((torch.maximum(last_start, last_label) + 1).sum())


class Rows(torch.utils.data.Dataset):
    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors
        self.covers = "every token"  # what the labels train: or "the assistant's turns"

    def __len__(self) -> int:
        return len(self.tensors["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.tensors.items()}


class Split:
    """data.path (and data.val_path) as the ranks train on it: read (kit.inputs.datafile), every
    row checked and rendered whole before the split (a problem names its row), split by a seeded
    permutation (the same on every rank and machine) and each text tokenized once: the longest
    row (data.max_seq_len=auto) and the rows at any length come from the same tokens."""

    def __init__(self, cfg: DataConfig, tokenizer, seed: int):
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.cfg = cfg
        auto = cfg.max_seq_len == AUTO  # uncut: the longest row is asked (packing: its row)
        cut = (PACKED_ROW if cfg.packing else None) if auto else cfg.max_seq_len
        rows = read_checked(cfg.path, cfg)  # every row checked here, where rows keep their numbers
        texts, spans = _chats(rows, cfg, tokenizer, cfg.path)
        self.path = tokens.Tokens(texts, tokenizer, spans, cut)  # data.path's rows
        if cfg.val_path:
            val_rows = read_checked(cfg.val_path, cfg, "data.val_path")
            val = _chats(val_rows, cfg, tokenizer, cfg.val_path, "data.val_path")
            self.train, self.val = self.path, tokens.Tokens(val[0], tokenizer, val[1], cut)
            return
        if cfg.val_fraction > 0:
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
            n_val = split_sizes(len(rows), cfg.val_fraction)[1]
            val_idx, train_idx = order[:n_val], order[n_val:]
        else:
            train_idx, val_idx = range(len(rows)), range(min(64, len(rows)))
        self.train, self.val = self.path.pick(train_idx), self.path.pick(val_idx)

    def longest(self) -> int:
        """Tokens in data.path's longest row (its end-of-sequence token included)."""
        return self.path.longest()

    def rows(self, max_len=None) -> tuple[Rows, Rows]:
        """(train, validation) rows of max_len tokens (default data.max_seq_len)."""
        max_len = self.cfg.max_seq_len if max_len is None else max_len
        encode = tokens.encode_packed if self.cfg.packing else tokens.encode

        def made(part: tokens.Tokens) -> Rows:
            rows = Rows(encode(part, max_len))
            rows.covers = "every token" if part.spans is None else "the assistant's turns"
            return rows

        return made(self.train), made(self.val)


def build_datasets(cfg: DataConfig, tokenizer, seed: int) -> tuple[Rows, Rows]:
    """(train, validation) tokenized rows at data.max_seq_len (`Split`)."""
    return Split(cfg, tokenizer, seed).rows()


def summary(train: Rows, val: Rows, cfg: DataConfig, training, world: int) -> str:
    """One line: what the run will see of its data (rows per split and per rank, tokens, what the
    loss covers) and how many epochs its steps make (each step takes batch x accumulation rows on
    every rank; the last incomplete batch of an epoch is dropped)."""
    batch_size, grad_accum, steps = training.batch_size, training.grad_accum, training.steps
    kind = "packed rows" if cfg.packing else "rows"
    per_step = batch_size * grad_accum * world
    per_epoch = max(1, len(train) // (batch_size * world) // grad_accum)
    return (f"data: {len(train)} training {kind} ({len(train) // world} per rank), "
            f"{count_tokens(train.tensors):,} tokens; {len(val)} validation {kind}; loss on "
            f"{train.covers}; {steps} steps x {per_step} {kind} = {steps / per_epoch:.1f} epochs "
            f"({per_epoch} steps each)")


def _one_row(rows: list[dict]) -> dict[str, torch.Tensor]:
    return {k: v.reshape(1, -1) for k, v in default_collate(rows).items()}


def loader(
    rows: Rows, batch_size: int, rank: int, world: int, seed: int, train: bool,
    one_row: bool = False,
):
    """Each rank sees its own slice (DistributedSampler); shuffled per epoch when training.
    one_row: each batch of packed rows joined into a single row, the only packed layout that
    transformers' flash_attention_2 recognises (modeling_flash_attention_utils._is_packed_sequence
    wants batch size 1; the labels' shift stays inside rows, whose first label is -100)."""
    if len(rows) < batch_size * world and not train:  # a small validation split: every row
        return short_split(rows, batch_size, rank, world, one_row)  # once, on fewer ranks
    fits(rows, batch_size, world)
    sampler = Sampler(rows, num_replicas=world, rank=rank, shuffle=train, seed=seed, drop_last=True)
    # A generator of its own: creating an iterator draws a seed from it, and drawing from the
    # global RNG instead would shift dropout after a resume restores the RNG states.
    generator = torch.Generator().manual_seed(seed)
    return DataLoader(
        rows, batch_size=batch_size, sampler=sampler, drop_last=True, generator=generator,
        collate_fn=_one_row if one_row else None,
    )


def fits(rows: Rows, batch_size: int, world: int) -> None:
    """Refuse a training split that cannot give every rank one full batch, naming the remedies."""
    if len(rows) >= batch_size * world:
        return
    packed = "position_ids" in rows.tensors  # packing joins samples: fewer rows
    smaller = f"training.batch_size={len(rows) // world}, " if len(rows) >= world else ""
    raise ConfigError(
        f"training.batch_size: {batch_size} is not allowed; the training split has {len(rows)} "
        f"{'packed rows' if packed else 'rows'}, which cannot fill {world} ranks x {batch_size}; "
        f"use {smaller}more rows in data.path, "
        f"{'data.packing=false (one row per sample), ' if packed else ''}or fewer processes")


def short_split(rows: Rows, batch_size: int, rank: int, world: int,
                one_row: bool = False) -> list[dict]:
    """Batches of a validation split too small to give every rank a full batch: row i goes to
    rank i % world, and every rank gets the same number of batches of the same size (a sharded
    model's forward is collective: each rank must run it as often as the others), filled up
    with copies of row 0 whose labels are all -100, so that they add no loss and no tokens.
    Every row is evaluated exactly once (DistributedSampler's drop_last would drop them all)."""
    mine = list(range(rank, len(rows), world))
    per_rank = -(-len(rows) // world)  # the most rows any rank gets
    filler = {k: v.clone() for k, v in rows[0].items()}
    filler["labels"].fill_(-100)
    picked = [rows[i] for i in mine] + [filler] * (-(-per_rank // batch_size) * batch_size - len(mine))
    collate = _one_row if one_row else default_collate
    return [collate(picked[i:i + batch_size]) for i in range(0, len(picked), batch_size)]


class Sampler(DistributedSampler):
    """DistributedSampler that can begin an epoch past the first `skip` samples of its order. It
    gives rank r the samples r, r + W, r + 2W, ...: after k per rank, the first k * W were seen,
    so a resume on any number of ranks continues there, none repeated, none skipped (on the same
    number, each rank draws exactly the batches it would have drawn next)."""

    skip = 0

    def __iter__(self):
        if not self.skip:
            return super().__iter__()
        order = (torch.randperm(len(self.dataset), generator=torch.Generator().manual_seed(
            self.seed + self.epoch)).tolist() if self.shuffle else list(range(len(self.dataset))))
        rest = order[: self.total_size][self.skip:]  # drop_last: as DistributedSampler
        return iter(rest[self.rank::self.num_replicas][: len(self)])

    def __len__(self) -> int:
        return max(0, self.total_size - self.skip) // self.num_replicas


class Batches:
    """Endless batches with a new shuffle each epoch (same on every rank, different slices), and
    a position (epoch, samples of it seen over every rank) that a checkpoint saves and a resume
    restores, on the same number of ranks or another (kit.recipe.data.Sampler)."""

    def __init__(self, dl: DataLoader):
        self.dl, self.epoch, self.index, self._it = dl, 0, 0, None
        self.start = 0  # samples of this epoch skipped at its start (a resume)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self._it is None:
            self.dl.sampler.set_epoch(self.epoch)
            self.dl.sampler.skip = self.start
            self._it = iter(self.dl)
        try:
            batch = next(self._it)
        except StopIteration:
            self.epoch, self.index, self.start, self._it = self.epoch + 1, 0, 0, None
            return next(self)
        self.index += 1
        return batch

    def seen(self) -> int:
        """Samples of the current epoch seen so far, over every rank."""
        return self.start + self.index * self.dl.batch_size * self.dl.sampler.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "samples": self.seen()}

    def load_state_dict(self, state: dict) -> None:  # no "samples": an older kit, same ranks
        start = state.get("samples", state["index"] * self.dl.batch_size * self.dl.sampler.num_replicas)
        self.epoch, self.index, self.start, self._it = state["epoch"], 0, start, None
        self.dl.sampler.skip = start  # len(self.dl): the epoch's batches left


# --------------------------------------------------------------------- what a fine-tune taught

ANSWER_FORM = re.compile(r"ANSWER: \S[^\n]*")  # the reply's form in kit/data/answer-format.jsonl


def packed_mask(position_ids: torch.Tensor, config) -> torch.Tensor:
    """(tokens x tokens) bool: where each token of one packed row may attend, as transformers
    builds it from the row's position ids (the mask sdpa receives in training)."""
    from transformers.masking_utils import create_causal_mask

    config = copy.copy(config)
    config._attn_implementation = "sdpa"
    n = position_ids.shape[-1]
    mask = create_causal_mask(config=config, inputs_embeds=torch.zeros(1, n, 1),
                              attention_mask=None, past_key_values=None,
                              position_ids=position_ids.reshape(1, n))  # fmt: skip
    # None: one sample in the row, sdpa's plain causal mask
    return torch.ones(n, n, dtype=torch.bool).tril() if mask is None else mask[0, 0]


@torch.no_grad()
def chat_replies(model, tokenizer, prompts: list[str], max_new_tokens: int = 16) -> list[str]:
    """Greedy replies to user prompts through the tokenizer's chat template, in one batch padded
    on the left (generation continues on the right)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in prompts]  # fmt: skip
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    out = model.generate(**enc.to(model.device), max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    new = out[:, enc["input_ids"].shape[1]:]
    return [r.strip() for r in tokenizer.batch_decode(new, skip_special_tokens=True)]


def score(replies: list[str], answers: list[str]) -> dict:
    """in_form: replies that are one line `ANSWER: <x>`; right: replies holding the expected
    answer as a word (in any form)."""
    def holds(reply: str, answer: str) -> bool:
        return re.search(rf"\b{re.escape(answer)}\b", reply, re.IGNORECASE) is not None

    return {"in_form": sum(bool(ANSWER_FORM.fullmatch(r)) for r in replies),
            "right": sum(holds(r, a) for r, a in zip(replies, answers, strict=True)),
            "of": len(replies)}  # fmt: skip
