"""Chat data for the llm family: JSONL conversations, the tokenizer's chat template, and an
assistant-only loss mask.

One conversation per line: ``{"messages": [{"role": "user", "content": "..."}, {"role":
"assistant", "content": "..."}]}``, roles ``system`` / ``user`` / ``assistant``. Every problem in a
file is reported at once, each as ``file:line: what is wrong``.

The mask (which tokens the loss sees) is found in characters first, then mapped to tokens:

1. The conversation is rendered with the tokenizer's own chat template (``tokenize=False``).
2. For assistant turn ``i``, the template renders ``messages[:i]`` with the generation prompt
   (``<|im_start|>assistant\\n`` in ChatML) and ``messages[:i+1]``; both are prefixes of the full
   text, and the assistant's text is what lies between them, with trailing whitespace dropped.
   That span is the content *and* the end-of-turn token (``<|im_end|>``), which the model must
   learn to emit to stop. The role header and the newline after ``<|im_end|>`` are not trained.
   A template that renders earlier turns differently once later turns follow (some drop
   reasoning from old turns) falls back to finding the content itself, plus the end-of-turn
   token if the tokenizer's EOS string follows it.
3. The full text is tokenized once (no extra special tokens: the template already wrote them)
   with character offsets; a token is supervised when its characters overlap an assistant span.

So the tokens trained on are exactly the tokens the model sees in training, whatever the
template, and there is no re-tokenization of pieces that could split differently.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ...errors import DataError, ImgloraError

ROLES = ("system", "user", "assistant")
IGNORE = -100  # label of tokens the loss skips (PyTorch's cross_entropy ignore_index)


@dataclass(frozen=True)
class Conversation:
    messages: tuple[dict[str, str], ...]
    where: str  # "file:line", for messages about this conversation

    @property
    def prompt(self) -> list[dict[str, str]]:
        """The messages before the last assistant turn (what a model is asked at evaluation)."""
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        return [dict(m) for m in self.messages[:last]]


def read_jsonl(path: str | Path) -> list[Conversation]:
    """Every conversation of ``path``; one ``DataError`` lists every malformed line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError([f"{path}: no such file (llm.data_file / llm.holdout_file)"]) from None
    except UnicodeDecodeError as exc:
        raise DataError([f"{path}: not UTF-8 text ({exc})"]) from None
    conversations, problems = [], []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})")
            continue
        messages, problem = _check(obj)
        if problem:
            problems.append(f"{where}: {problem}")
        else:
            conversations.append(Conversation(messages, where))
    if problems:
        raise DataError(problems)
    if not conversations:
        raise DataError([f"{path}: no conversations (expected one {{\"messages\": [...]}} per line)"])
    return conversations


def _check(obj: Any) -> tuple[tuple[dict[str, str], ...], str]:
    if not isinstance(obj, dict):
        return (), f"expected an object {{\"messages\": [...]}}, got {type(obj).__name__}"
    if "messages" not in obj:
        return (), f"missing \"messages\" (keys: {', '.join(map(str, obj)) or 'none'})"
    messages = obj["messages"]
    if not isinstance(messages, list) or not messages:
        return (), "\"messages\" must be a non-empty list of {\"role\", \"content\"} objects"
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            return (), f"messages[{i}]: expected an object with \"role\" and \"content\", got {type(m).__name__}"
        role = m.get("role")
        if role not in ROLES:
            return (), f"messages[{i}]: bad role {role!r}; expected one of {', '.join(ROLES)}"
        content = m.get("content")
        if not isinstance(content, str):
            what = "missing" if "content" not in m else f"a {type(content).__name__}, not a string"
            return (), f"messages[{i}] ({role}): content is {what}"
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        return (), "no assistant turn: nothing to train on"
    return tuple(out), ""


# ----------------------------------------------------------------------------------------------
# Rendering and the assistant mask


def render(tokenizer: Any, messages: Sequence[dict[str, str]], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: Any, messages: Sequence[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span of each assistant turn (content and
    end-of-turn token; see the module docstring)."""
    full = render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        span = None
        if i > 0:
            before = render(tokenizer, messages[:i], generation_prompt=True)
            upto = render(tokenizer, messages[:i + 1])
            if full.startswith(before) and full.startswith(upto) and len(before) >= cursor:
                end = len(upto.rstrip())
                if end > len(before):
                    span = (len(before), end)
        if span is None:
            span = _find_content(full, m["content"], cursor, tokenizer.eos_token)
        spans.append(span)
        cursor = span[1]
    return full, spans


def _find_content(full: str, content: str, cursor: int, eos: str | None) -> tuple[int, int]:
    for text in (content, content.strip()):
        start = full.find(text, cursor) if text else -1
        if start >= 0:
            end = start + len(text)
            rest = full[end:]
            if eos and rest.lstrip().startswith(eos):
                end += len(rest) - len(rest.lstrip()) + len(eos)
            return start, end
    raise ImgloraError("the chat template does not reproduce an assistant message verbatim, so the "
                       "assistant-only loss mask cannot be placed")


@dataclass(frozen=True)
class Encoded:
    input_ids: list[int]
    labels: list[int]  # the token id where the loss applies, IGNORE elsewhere
    length: int  # tokens before truncation
    truncated: bool

    @property
    def supervised(self) -> int:
        """Tokens the loss sees (the first token has no predecessor to be predicted from)."""
        return sum(1 for x in self.labels[1:] if x != IGNORE)


def encode(tokenizer: Any, messages: Sequence[dict[str, str]], max_seq_len: int) -> Encoded:
    """Token ids and assistant-only labels, truncated (from the right) to ``max_seq_len``."""
    full, spans = assistant_spans(tokenizer, messages)
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise ImgloraError(f"the tokenizer ({type(tokenizer).__name__}) gives no character offsets, which the "
                           "assistant-only loss mask needs; use the model's fast tokenizer (tokenizer.json)") from None
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    labels = [t if _overlaps(tok_span, spans) else IGNORE for t, tok_span in zip(ids, offsets)]
    n = len(ids)
    return Encoded(ids[:max_seq_len], labels[:max_seq_len], n, n > max_seq_len)


def _overlaps(tok: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    start, end = tok
    return end > start and any(start < s_end and s_start < end for s_start, s_end in spans)


# ----------------------------------------------------------------------------------------------
# The length report


@dataclass(frozen=True)
class LengthReport:
    n: int
    truncated: int  # conversations longer than max_seq_len
    median: float
    p95: float
    longest: int
    max_seq_len: int

    def summary(self) -> str:
        return (f"token lengths median {self.median:g}, 95th percentile {self.p95:g}, longest {self.longest}; "
                f"{self.truncated} of {self.n} truncated to llm.max_seq_len = {self.max_seq_len}")

    def warning(self) -> str | None:
        if not self.truncated:
            return None
        share = 100 * self.truncated / self.n
        keep = math.ceil(self.p95)
        hint = (f"raise llm.max_seq_len to about {keep} to keep 95% whole"
                if keep > self.max_seq_len else "shorten or split the longest conversations")
        return (f"{self.truncated} of {self.n} conversations ({share:.1f}%) are longer than llm.max_seq_len = "
                f"{self.max_seq_len} tokens and were cut (their tail is not trained on); lengths: median "
                f"{self.median:g}, 95th percentile {self.p95:g}, longest {self.longest}. To keep more, {hint}.")


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile with linear interpolation between ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of no values")
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def length_report(lengths: Sequence[int], max_seq_len: int) -> LengthReport:
    return LengthReport(n=len(lengths), truncated=sum(1 for n in lengths if n > max_seq_len),
                        median=percentile(lengths, 50), p95=percentile(lengths, 95), longest=max(lengths),
                        max_seq_len=max_seq_len)
