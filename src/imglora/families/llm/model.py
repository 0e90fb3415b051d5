"""The chat family's model: a transformers causal LM whose next-token loss covers the assistant's
tokens only, with logits computed only where the loss reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .data import pad_id

# Qwen/Qwen2.5-7B-Instruct's config.json (the architecture of presets/qlora-llm.toml), for benchmarks.
FULL_CONFIG: dict[str, Any] = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)


class LlmTrainable:
    """The causal LM and its next-token loss over assistant tokens."""

    def __init__(self, model: Any):
        self.model = model
        self.facts: dict[str, Any] = {}

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> torch.Tensor:
        # The (vocabulary-wide, so large) logits are computed only at the positions the loss reads:
        # [N, vocab] instead of [batch, length, vocab]. Positions come from the host (see collate).
        hidden = self.model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                          use_cache=False).last_hidden_state
        picked = hidden.flatten(0, 1).index_select(0, batch["positions"])
        logits = self.model.get_output_embeddings()(picked)
        return torch.nn.functional.cross_entropy(logits.float(), batch["targets"])


def base_model_name(path: str, folder: Path) -> str:
    """What ``adapter_config.json`` names as the base: the hub id as the preset gives it, else the
    resolved local folder (``tiny:llm`` and relative paths mean nothing elsewhere)."""
    from ...models.resolve import looks_like_hub_id

    local = Path(path).expanduser()
    if not path.startswith("tiny:") and not local.exists() and looks_like_hub_id(path):
        return path
    return str(Path(folder).resolve())


def _enable_checkpointing(model: Any) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x name
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _give_add_adapter(model: Any) -> None:
    """``lora.inject`` calls ``model.add_adapter(config)``. transformers' own version refuses peft
    older than it wants (5.24 asks for peft >= 0.22); it is a thin wrapper around
    ``peft.inject_adapter_in_model``, which is what this instance method calls directly (the
    adapter is named "default" and ``model.peft_config`` is set, as transformers would)."""

    def add_adapter(adapter_config: Any, adapter_name: str | None = None) -> None:
        from peft import inject_adapter_in_model

        inject_adapter_in_model(adapter_config, model, adapter_name or "default")

    model.add_adapter = add_adapter


EVAL_MAX_NEW_TOKENS = 256


class _Answerer:
    """Greedy answers of the model as it is (the eval pass sets the adapter strength before each call)."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, max_new_tokens: int):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.max_new_tokens = max_new_tokens
        self.settings = {"decoding": "greedy", "max_new_tokens": max_new_tokens}

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor, seed: int) -> str:
        ids = ids.to(self.device)[None]
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=self.max_new_tokens, pad_token_id=pad_id(self.tokenizer))
        return self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
