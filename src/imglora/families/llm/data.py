"""The chat family's data: conversations split into training and validation, tokenized with the
model's chat template (see ``chat``), and the dataset's version."""

from __future__ import annotations

import hashlib
import math
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...data.samples import PreparedData, Sample
from ...errors import DataError, ImgloraError
from ...util.hashing import sha256_file
from .chat import IGNORE, Conversation, encode, length_report, read_jsonl

if TYPE_CHECKING:
    from ...models.source import ModelSource

LENGTH_BUCKET = 64  # conversations are batched with others of similar length (less padding)


def prepare(cfg: Any, src: "ModelSource") -> tuple[PreparedData, int]:
    """Training and validation samples, and the tokenizer's padding id."""
    tokenizer = load_tokenizer(src.root)
    padding = pad_id(tokenizer)
    train_convs, valid_convs, warnings = split_conversations(cfg)
    max_len = cfg.family.max_seq_len
    problems: list[str] = []

    def encode_all(convs: list[Conversation]) -> list[tuple[Conversation, Any]]:
        out = []
        for conv in convs:
            try:
                out.append((conv, encode(tokenizer, conv.messages, max_len)))
            except ImgloraError as exc:
                problems.append(f"{conv.where}: {exc}")
            except Exception as exc:  # the template's own checks (e.g. roles must alternate)
                problems.append(f"{conv.where}: the chat template cannot render it: {exc}")
        return out

    train_enc, valid_enc = encode_all(train_convs), encode_all(valid_convs)
    if problems:
        raise DataError(problems)
    report = length_report([e.length for _, e in train_enc + valid_enc], max_len)
    if report.warning():
        warnings.append(report.warning())

    skipped: list[str] = []

    def samples(encoded: list[tuple[Conversation, Any]]) -> list[Any]:
        out = []
        for conv, e in encoded:
            if not e.supervised:  # truncation cut every assistant token: nothing to learn
                skipped.append(f"{conv.where} ({e.length} tokens)")
                continue
            entry = {"input_ids": torch.tensor(e.input_ids, dtype=torch.long),
                     "labels": torch.tensor(e.labels, dtype=torch.long)}
            out.append(Sample((length_bucket(len(e.input_ids)), 0), 1, (entry,)))
        return out

    train_samples, valid_samples = samples(train_enc), samples(valid_enc)
    if skipped:
        more = f" and {len(skipped) - 5} more" if len(skipped) > 5 else ""
        what = f"{len(skipped)} conversations have" if len(skipped) != 1 else "1 conversation has"
        warnings.append(f"{what} no assistant token within llm.max_seq_len = {max_len}; skipped: "
                        f"{', '.join(skipped[:5])}{more}")
    if not train_samples:
        raise DataError([f"{cfg.family.data_file}: no conversation has an assistant token within llm.max_seq_len"])
    supervised = sum(int((s.variants[0]["labels"] != IGNORE).sum()) for s in train_samples)
    source = cfg.family.holdout_file or f"a {cfg.family.holdout_fraction:g} split of {cfg.family.data_file}"
    held = f"; {len(valid_samples)} for validation from {source}" if valid_samples else ""
    summary = (f"{len(train_samples)} training conversations from {cfg.family.data_file}{held}; {supervised:,} "
               f"assistant tokens trained on; {report.summary()}")
    return PreparedData(train_samples, dataset_version(cfg), tuple(warnings), summary, valid_samples), padding


def load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not getattr(tokenizer, "chat_template", None):
        raise ImgloraError(f"the tokenizer in {folder} has no chat template; the llm family trains chat "
                           "models (use an -Instruct / -Chat model, or add a chat_template to tokenizer_config.json)")
    return tokenizer


def pad_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(tid, int):
            return tid
    return 0


def length_bucket(n: int) -> int:
    return int(math.ceil(n / LENGTH_BUCKET) * LENGTH_BUCKET)


def split_conversations(cfg: Any) -> tuple[list[Conversation], list[Conversation], list[str]]:
    """(training, validation, warnings): validation from eval.holdout_file, else a deterministic
    eval.holdout_fraction of data.file (a pure function of train.seed and the file)."""
    warnings: list[str] = []
    convs = read_jsonl(cfg.family.data_file)
    ev = cfg.family
    if ev.holdout_file:
        if ev.holdout_fraction:
            warnings.append(f"llm.holdout_file is set, so llm.holdout_fraction = {ev.holdout_fraction:g} is ignored")
        return convs, read_jsonl(ev.holdout_file), warnings
    if not ev.holdout_fraction:
        return convs, [], warnings
    n_held = max(1, round(len(convs) * ev.holdout_fraction))
    if n_held >= len(convs):
        raise DataError([(f"{cfg.family.data_file}: {len(convs)} conversations are too few to hold out "
                          f"llm.holdout_fraction = {ev.holdout_fraction:g} for validation")])
    order = list(range(len(convs)))
    random.Random(f"{cfg.train.seed}/holdout").shuffle(order)
    held = set(order[:n_held])
    return ([c for i, c in enumerate(convs) if i not in held], [c for i, c in enumerate(convs) if i in held],
            warnings)


def held_out_conversations(cfg: Any) -> list[Conversation]:
    """The validation conversations of a run (for the evaluation pass)."""
    return split_conversations(cfg)[1]


def dataset_version(cfg: Any) -> str:
    """sha256 of data.file's bytes; with eval.holdout_file, a sha256 over both files' digests."""
    digest = sha256_file(Path(cfg.family.data_file))
    if not cfg.family.holdout_file:
        return digest
    both = f"train:{digest}\nvalidation:{sha256_file(Path(cfg.family.holdout_file))}\n"
    return hashlib.sha256(both.encode()).hexdigest()


