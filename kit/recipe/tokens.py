"""Texts tokenized once, then made into training rows: padded rows (`encode`) or packed ones
(`encode_packed`), at whatever length the run trains at.

    tokens = Tokens(texts, tokenizer, spans, cut=None)   # each text with its end-of-sequence token
    tokens.longest()                                     # data.max_seq_len=auto's measure
    encode(tokens, 512)                                  # input_ids, attention_mask, labels

One tokenization serves both questions a start asks of the data (how long its longest row is,
and what its rows are at the planned length): a row longer than the length asked for is cut by
the tokenizer itself (its own truncation: special tokens and its truncation side kept), the
others are taken as they are, so the rows are what one padded and truncated call would give.

With packing, several samples share a row (`encode_packed`): rows carry `position_ids` that
restart at 0 per sample and no `attention_mask`, which is how transformers recognises packed rows
(masking_utils.find_packed_sequence_indices).
"""

from __future__ import annotations

import torch

from kit.inputs.datafile import PACKED_ROW


class Tokens:
    """`texts` (each with the tokenizer's end-of-sequence token) tokenized once, cut at `cut`
    tokens (None: uncut), not padded; with `spans` (the assistant's turns, as character spans)
    their character offsets too."""

    def __init__(self, texts: list[str], tokenizer, spans: list | None = None,
                 cut: int | None = None):
        eos = tokenizer.eos_token
        self.texts = [t + eos for t in texts] if eos else list(texts)
        self.tokenizer, self.spans, self.cut = tokenizer, spans, cut
        self.ids, self.offsets = self._tokenize(self.texts, cut)

    def _tokenize(self, texts: list[str], cut: int | None):
        enc = self.tokenizer(texts, max_length=cut, truncation=cut is not None,
                             return_offsets_mapping=self.spans is not None)
        return enc["input_ids"], enc["offset_mapping"] if self.spans is not None else None

    def pick(self, index) -> Tokens:
        """These rows (a split of them), their tokens as they are: none tokenized again."""
        out = object.__new__(Tokens)
        out.tokenizer, out.cut = self.tokenizer, self.cut
        out.texts, out.ids = [self.texts[i] for i in index], [self.ids[i] for i in index]
        out.offsets = None if self.offsets is None else [self.offsets[i] for i in index]
        out.spans = None if self.spans is None else [self.spans[i] for i in index]
        return out

    def longest(self) -> int:
        return max((len(ids) for ids in self.ids), default=0)

    def at(self, length: int) -> tuple[list, list | None]:
        """(ids, offsets) of every row at most `length` tokens long: the longer ones tokenized
        again with the tokenizer's truncation (only they: the others are what it would give)."""
        long = [i for i, ids in enumerate(self.ids) if len(ids) > length]
        if not long:
            return self.ids, self.offsets
        ids, offsets = list(self.ids), None if self.offsets is None else list(self.offsets)
        cut_ids, cut_offsets = self._tokenize([self.texts[i] for i in long], length)
        for k, i in enumerate(long):
            ids[i] = cut_ids[k]
            if offsets is not None:
                offsets[i] = cut_offsets[k]
        return ids, offsets


def trained(offsets, spans: list[tuple[int, int]]) -> list[bool]:
    """Per token (its character offsets), whether it overlaps an assistant span (a token may
    begin before one: " 23" takes the space that ends the generation prompt)."""
    return [e > s and any(s < b and e > a for a, b in spans) for s, e in offsets]


def encode(tokens: Tokens, max_len) -> dict[str, torch.Tensor]:
    """Rows of max_len tokens ("auto" outside a planned run: the longest row's), cut where
    longer, padded on the tokenizer's padding side; no loss on padding, nor, where only the
    assistant's turns train, on what is not theirs."""
    ids, offsets = (tokens.ids, tokens.offsets) if max_len == "auto" else tokens.at(max_len)
    length = max((len(row) for row in ids), default=0) if max_len == "auto" else max_len
    tokenizer, n = tokens.tokenizer, len(ids)
    input_ids = torch.full((n, length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((n, length), dtype=torch.long)
    keep = torch.zeros((n, length), dtype=torch.bool)
    left = tokenizer.padding_side == "left"
    for i, row in enumerate(ids):
        at = slice(length - len(row), length) if left else slice(0, len(row))
        input_ids[i, at] = torch.tensor(row, dtype=torch.long)
        mask[i, at] = 1
        if tokens.spans is not None:
            keep[i, at] = torch.tensor(trained(offsets[i], tokens.spans[i]), dtype=torch.bool)
    labels = input_ids.clone()
    labels[mask == 0] = -100  # no loss on padding
    if tokens.spans is not None:  # nor on what is not the assistant's
        labels[~keep] = -100
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def encode_packed(tokens: Tokens, max_len) -> dict[str, torch.Tensor]:
    """Samples (each cut to max_len) packed greedily, in order, into rows of max_len tokens.
    transformers' DataCollatorWithFlattening joins each row's samples: position ids restart at 0,
    and every sample's first label is -100, so no token predicts across a boundary. The row's
    tail is padding: pad tokens, labels -100, position ids continuing the last sample's (it stays
    one sample to transformers, so kit.recipe.data.count_tokens can tell padding from a sample
    start)."""
    from transformers import DataCollatorWithFlattening

    max_len = PACKED_ROW if max_len == "auto" else max_len
    ids, offsets = tokens.at(max_len)
    samples = [{"input_ids": row} for row in ids]
    if tokens.spans is not None:
        for sample, offset, span in zip(samples, offsets, tokens.spans, strict=True):
            sample["labels"] = [i if t else -100 for i, t in
                                zip(sample["input_ids"], trained(offset, span), strict=True)]
    groups: list[list[dict]] = []
    used = max_len + 1  # forces a first row
    for sample in filter(lambda s: s["input_ids"], samples):
        if used + len(sample["input_ids"]) > max_len:
            groups.append([])
            used = 0
        groups[-1].append(sample)
        used += len(sample["input_ids"])
    flatten = DataCollatorWithFlattening()
    n_rows = len(groups)
    pad = tokens.tokenizer.pad_token_id
    out = {
        "input_ids": torch.full((n_rows, max_len), pad, dtype=torch.long),
        "labels": torch.full((n_rows, max_len), -100, dtype=torch.long),
        "position_ids": torch.zeros((n_rows, max_len), dtype=torch.long),
    }
    for i, group in enumerate(groups):
        row = flatten(group, return_tensors="pt")
        n = row["input_ids"].shape[1]
        last = n - len(group[-1]["input_ids"])  # where the last sample starts
        for key in out:
            out[key][i, :n] = row[key][0]
        out["position_ids"][i, last:] = torch.arange(max_len - last)
    return out
