"""Chat LLMs (QLoRA): a transformers causal LM, frozen weights in 4 bits, LoRA on every linear
projection of the decoder, loss on the assistant's tokens only.

Data is a JSONL of conversations rendered with the tokenizer's own chat template (``chat``);
nothing is cached, tokenizing is fast. The adapter is a PEFT folder (``adapter_config.json`` +
``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight`` keys), which
``PeftModel.from_pretrained`` and ``vllm serve --enable-lora --lora-modules name=PATH`` load as is;
``imglora merge`` folds it into the full-precision base (``merge``). It implements ``Family``,
``Sampler``, ``Benchable`` and ``Mergeable`` (see ``imglora.family``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from ...util.owned import own_module
from . import data, merge as merging, tiny
from .chat import IGNORE
from .config import LlmConfig
from .model import (EVAL_MAX_NEW_TOKENS, FULL_CONFIG, LlmTrainable, _Answerer, _enable_checkpointing,
                    _give_add_adapter, base_model_name)

if TYPE_CHECKING:
    from ...memory.swap import SwapLayout
    from ...models.source import ModelSource

ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name (SAFETENSORS_WEIGHTS_NAME)
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before module paths


class LlmFamily:
    name = "llm"
    section = LlmConfig
    model_marker = "config.json"
    adapter_file = ADAPTER_FILE
    adapter_format = "a PEFT adapter folder: PeftModel.from_pretrained, vllm serve --enable-lora"
    # "All linear layers" of a Llama/Qwen/Mistral-style decoder, by name (vLLM and PEFT both want
    # names; lm_head and the embeddings are not adapted).
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    lora_scope = ""
    quantize_exclude = ("lm_head", "*embed_tokens*")
    quantizations = ("qint4", "nf4")
    adapter_types = ("lora",)

    def __init__(self) -> None:
        self.pad_id = 0  # set from the tokenizer by prepare_data; padded positions are masked anyway

    def check_config(self, cfg: Any, where: Callable[[str], str], problems: list[str]) -> None:
        if not cfg.family.data_file:
            problems.append(f"{where('llm.data_file')}: missing required key for the llm family (a JSONL of "
                            "conversations)")
        if cfg.train.loss_type != "l2":
            problems.append(f"{where('train.loss_type')}: the llm family trains on the answers' cross-entropy; "
                            "loss_type is for the image families: remove it")

    def build_tiny(self, dest: Path, seed: int) -> None:
        tiny.build(dest, seed)

    # -- data ---------------------------------------------------------------------------------
    def prepare_data(self, cfg: Any, src: "ModelSource", device: torch.device) -> Any:
        prepared, self.pad_id = data.prepare(cfg, src)
        return prepared

    def data_version(self, cfg: Any) -> str:
        return data.dataset_version(cfg)

    def collate(self, entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Right-pad to the longest entry; ``keep`` marks the positions whose next token is
        supervised (only their logits are computed) and ``targets`` lists those next tokens."""
        n = max(e["input_ids"].numel() for e in entries)
        input_ids = torch.full((len(entries), n), self.pad_id, dtype=torch.long)
        labels = torch.full((len(entries), n), IGNORE, dtype=torch.long)
        attention_mask = torch.zeros((len(entries), n), dtype=torch.long)
        for i, e in enumerate(entries):
            k = e["input_ids"].numel()
            input_ids[i, :k] = e["input_ids"]
            labels[i, :k] = e["labels"]
            attention_mask[i, :k] = 1
        keep = torch.zeros((len(entries), n), dtype=torch.bool)
        keep[:, :-1] = labels[:, 1:] != IGNORE
        # Built here on the host, so the step needs no data-dependent shape (a boolean mask on the
        # device would be a nonzero(), i.e. a host-device sync, every micro-batch).
        targets = labels[:, 1:][keep[:, :-1]]
        positions = keep.flatten().nonzero().squeeze(1)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "positions": positions, "targets": targets}

    @staticmethod
    def loss_units(entries: list[dict[str, torch.Tensor]]) -> int:
        """What the loss averages over: the supervised next tokens (data-parallel processes weight
        their share of a batch by these)."""
        return sum(int((e["labels"][1:] != IGNORE).sum()) for e in entries)

    # -- model --------------------------------------------------------------------------------
    def load_trainable(self, src: "ModelSource", cfg: Any, device: torch.device, dtype: torch.dtype,
                       swap: "SwapLayout") -> LlmTrainable:
        from transformers import AutoModelForCausalLM

        # On the CPU: apply_memory quantizes layer by layer, then moves the model to the device.
        model = own_module(AutoModelForCausalLM.from_pretrained(src.root, dtype=dtype))
        model.config.use_cache = False  # a KV cache is useless in training and conflicts with checkpointing
        if cfg.memory.gradient_checkpointing:
            # Non-reentrant: works with a frozen base (no enable_input_require_grads needed) and
            # with quantized weights.
            _enable_checkpointing(model)
        model.imglora_base_model = base_model_name(cfg.model.path, src.root)
        _give_add_adapter(model)
        return LlmTrainable(model)

    def full_trainable(self, cfg: Any, dtype: torch.dtype, swap: "SwapLayout",
                       device: torch.device | None = None) -> "LlmTrainable":
        """Qwen2.5-7B-Instruct's architecture with random weights (no download), for benchmarks.

        Always built on the host (``device`` is not used; the LLM has no swappable blocks): its 4-bit quantization runs on the whole model later."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        from ...models.tiny import random_init

        config = AutoConfig.for_model(**FULL_CONFIG)
        with init_empty_weights(include_buffers=False):  # weights on meta, RoPE's inv_freq computed
            model = AutoModelForCausalLM.from_config(config)
        buffers = dict(model.named_buffers())
        model = random_init(model, dtype)  # (to_empty also empties the buffers: restore them)
        for name, b in buffers.items():
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, b)
        model.config.use_cache = False
        if cfg.memory.gradient_checkpointing:
            _enable_checkpointing(model)
        _give_add_adapter(model)
        return LlmTrainable(model)

    def synthetic_batch(self, trainable: "LlmTrainable", resolution: int, cfg: Any,
                        device: torch.device) -> dict[str, torch.Tensor]:
        """Random token ids of data.max_seq_len, every position supervised (the worst case), for
        benchmarks; ``resolution`` is ignored."""
        g = torch.Generator().manual_seed(0)
        vocab = trainable.model.config.vocab_size
        ids = torch.randint(0, vocab, (cfg.train.batch_size, cfg.family.max_seq_len), generator=g)
        batch = self.collate([{"input_ids": row, "labels": row} for row in ids])
        return {k: v.to(device) for k, v in batch.items()}

    def save_adapter(self, model: torch.nn.Module, peft_config: Any, folder: Path,
                     text_encoders: dict[str, Any] | None = None) -> Path:
        """A PEFT adapter folder, exactly as ``PeftModel.save_pretrained`` writes one."""
        from peft.utils import get_peft_model_state_dict

        from ...util import atomic

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(peft_config)  # the live config stays as peft injected it
        config.base_model_name_or_path = getattr(model, "imglora_base_model", None) or model.config._name_or_path
        config.task_type = "CAUSAL_LM"
        config.inference_mode = True
        if isinstance(config.target_modules, set):
            config.target_modules = sorted(config.target_modules)
        config.save_pretrained(str(folder))
        # save_embedding_layers=False: with lm_head among the targets peft would also save the whole
        # (frozen, unchanged) lm_head weight, which is not part of the adapter and which vLLM rejects.
        state = get_peft_model_state_dict(model, save_embedding_layers=False)
        weights = {PEFT_PREFIX + k: v.detach().to("cpu", copy=True).contiguous() for k, v in state.items()}
        atomic.save_safetensors(folder / ADAPTER_FILE, weights, metadata={"format": "pt"})
        return folder / ADAPTER_FILE

    # -- evaluation ----------------------------------------------------------------------------
    def default_prompts(self, cfg: Any) -> list[str]:
        """The last user message of up to 4 held-out conversations (training ones when none are held out)."""
        convs = data.held_out_conversations(cfg) or data.split_conversations(cfg)[0]
        return [next(m["content"] for m in reversed(c.prompt) if m["role"] == "user") for c in convs[:4]]

    def encode_prompts(self, src: "ModelSource", prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        tokenizer = data.load_tokenizer(src.root)
        out = []
        for p in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True)
            out.append(torch.tensor(tokenizer(text, add_special_tokens=False).input_ids))
        return out

    def load_sampler(self, src: "ModelSource", model: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Any:
        return _Answerer(model, data.load_tokenizer(src.root), device, EVAL_MAX_NEW_TOKENS)

    def read_adapter(self, folder: Path, component: str | None = None) -> dict[str, torch.Tensor]:
        """LoRA state keyed as ``get_peft_model_state_dict`` keys it (``model.layers.0...lora_A.weight``)."""
        from ...util.owned import load_file

        weights = load_file(Path(folder) / ADAPTER_FILE)
        return {k.removeprefix(PEFT_PREFIX): v for k, v in weights.items()}


    # -- merge --------------------------------------------------------------------------------
    def merge(self, run_dir: Path, cfg: Any, out: Path, *, which: str | None, dtype: str, force: bool,
              log: Callable[[str], None]) -> Path:
        return merging.merge(self, run_dir, cfg, out, which=which, dtype=dtype, force=force, log=log)
