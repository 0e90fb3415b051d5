"""The ``[llm]`` preset section: settings only the chat-LLM family reads."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import setting


@dataclass(frozen=True)
class LlmConfig:
    data_file: str = setting("", help="JSONL of conversations, one {\"messages\": [...]} per line.",
                             moved_from="data.file")
    max_seq_len: int = setting(2048, help="Tokens per example; longer conversations are truncated.", min=16,
                               max=1_000_000, moved_from="data.max_seq_len")
    holdout_file: str = setting("", help="A separate JSONL of validation conversations.",
                                moved_from="eval.holdout_file")
    holdout_fraction: float = setting(0.0, help="Fraction of conversations held out for validation.", min=0.0,
                                      max=0.9, moved_from="eval.holdout_fraction")
