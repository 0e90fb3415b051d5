"""Chat LLMs (QLoRA): a transformers causal LM, frozen weights in 4 bits, LoRA on every linear
projection of the decoder, loss on the assistant's tokens only.

Data is a JSONL of conversations rendered with the tokenizer's own chat template
(:mod:`imglora.data.chat`); nothing is cached, tokenizing is fast. The adapter is a PEFT folder
(``adapter_config.json`` + ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight``
keys), which ``PeftModel.from_pretrained`` and ``vllm serve --enable-lora --lora-modules name=PATH``
load as is; ``imglora merge`` folds it into the full-precision base.
"""

from __future__ import annotations

import copy
import hashlib
import math
import random
from pathlib import Path
from typing import Any, ClassVar

import torch

from ..data.chat import IGNORE, Conversation

ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name (SAFETENSORS_WEIGHTS_NAME)
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before module paths
LENGTH_BUCKET = 64  # conversations are batched with others of similar length (less padding)
# Qwen/Qwen2.5-7B-Instruct's config.json (the architecture of presets/qlora-llm.toml), for benchmarks.
FULL_CONFIG: dict[str, Any] = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, tie_word_embeddings=False,
    bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)


class LlmFamily:
    name: ClassVar[str] = "llm"
    bucket_step: ClassVar[int] = LENGTH_BUCKET
    text_max_length: ClassVar[int] = 0  # not used: no text-encoder cache
    # "All linear layers" of a Llama/Qwen/Mistral-style decoder, by name (vLLM and PEFT both want
    # names; lm_head and the embeddings are not adapted).
    lora_targets: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj")
    quantize_exclude: ClassVar[tuple[str, ...]] = ("lm_head", "*embed_tokens*")
    swappable_blocks: ClassVar[tuple[str, ...]] = ()
    denoiser: ClassVar[str] = "model"  # informational: the trained module is the whole causal LM
    pipeline: ClassVar[str] = ""
    lora_scope: ClassVar[str] = ""

    def __init__(self) -> None:
        self.pad_id = 0  # set from the tokenizer by prepare_data; padded positions are masked anyway

    # -- cache (the llm family has none: see prepare_data) -----------------------------------
    def vae_folders(self, model_dir: Path) -> list[Path]:
        return []

    def text_folders(self, model_dir: Path) -> list[Path]:
        return []

    def load_vae(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
        raise NotImplementedError("the llm family has no VAE")

    def encode_image(self, vae: Any, pixels: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError("the llm family has no images")

    def load_text_encoders(self, model_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
        raise NotImplementedError("the llm family caches no text-encoder outputs")

    def encode_text(self, encoders: Any, caption: str, max_length: int) -> dict[str, torch.Tensor]:
        raise NotImplementedError("the llm family caches no text-encoder outputs")

    # -- data ---------------------------------------------------------------------------------
    def prepare_data(self, cfg: Any, model_dir: Path, device: torch.device) -> Any:
        from ..data.cache import PreparedData, Sample
        from ..data.chat import encode, length_report
        from ..errors import DataError, ImgloraError

        tokenizer = load_tokenizer(model_dir)
        self.pad_id = pad_id(tokenizer)
        train_convs, valid_convs, warnings = split_conversations(cfg)
        max_len = cfg.data.max_seq_len
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
            warnings.append(f"{what} no assistant token within data.max_seq_len = {max_len}; skipped: "
                            f"{', '.join(skipped[:5])}{more}")
        if not train_samples:
            raise DataError([f"{cfg.data.file}: no conversation has an assistant token within data.max_seq_len"])
        supervised = sum(int((s.variants[0]["labels"] != IGNORE).sum()) for s in train_samples)
        source = cfg.eval.holdout_file or f"a {cfg.eval.holdout_fraction:g} split of {cfg.data.file}"
        held = f"; {len(valid_samples)} for validation from {source}" if valid_samples else ""
        summary = (f"{len(train_samples)} training conversations from {cfg.data.file}{held}; {supervised:,} "
                   f"assistant tokens trained on; {report.summary()}")
        return PreparedData(train_samples, dataset_version(cfg), tuple(warnings), summary, valid_samples)

    def data_version(self, cfg: Any) -> str:
        return dataset_version(cfg)

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

    # -- model --------------------------------------------------------------------------------
    def load_trainable(self, model_dir: Path, cfg: Any, device: torch.device, dtype: torch.dtype) -> "LlmTrainable":
        from transformers import AutoModelForCausalLM

        # On the CPU: apply_memory quantizes layer by layer, then moves the model to the device.
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.config.use_cache = False  # a KV cache is useless in training and conflicts with checkpointing
        if cfg.memory.gradient_checkpointing:
            # Non-reentrant: works with a frozen base (no enable_input_require_grads needed) and
            # with quantized weights.
            _enable_checkpointing(model)
        model.imglora_base_model = base_model_name(cfg.model.path, model_dir)
        _give_add_adapter(model)
        return LlmTrainable(model)

    def full_trainable(self, cfg: Any, dtype: torch.dtype) -> "LlmTrainable":
        """Qwen2.5-7B-Instruct's architecture with random weights (no download), for benchmarks."""
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM

        from .diffusers_common import random_init

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
        ids = torch.randint(0, vocab, (cfg.train.batch_size, cfg.data.max_seq_len), generator=g)
        batch = self.collate([{"input_ids": row, "labels": row} for row in ids])
        return {k: v.to(device) for k, v in batch.items()}

    def save_adapter(self, model: torch.nn.Module, peft_config: Any, folder: Path) -> Path:
        """A PEFT adapter folder, exactly as ``PeftModel.save_pretrained`` writes one."""
        from peft.utils import get_peft_model_state_dict

        from .. import atomic

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
        convs = held_out_conversations(cfg) or split_conversations(cfg)[0]
        return [next(m["content"] for m in reversed(c.prompt) if m["role"] == "user") for c in convs[:4]]

    def encode_prompts(self, model_dir: Path, prompts: list[str], cfg: Any, device: torch.device) -> list[Any]:
        tokenizer = load_tokenizer(model_dir)
        out = []
        for p in prompts:
            text = tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                 add_generation_prompt=True)
            out.append(torch.tensor(tokenizer(text, add_special_tokens=False).input_ids))
        return out

    def load_sampler(self, model_dir: Path, model: torch.nn.Module, cfg: Any, device: torch.device,
                     dtype: torch.dtype) -> Any:
        return _Answerer(model, load_tokenizer(model_dir), device, EVAL_MAX_NEW_TOKENS)

    def read_adapter(self, folder: Path) -> dict[str, torch.Tensor]:
        """LoRA state keyed as ``get_peft_model_state_dict`` keys it (``model.layers.0...lora_A.weight``)."""
        from safetensors.torch import load_file

        weights = load_file(str(Path(folder) / ADAPTER_FILE))
        return {k.removeprefix(PEFT_PREFIX): v for k, v in weights.items()}


class LlmTrainable:
    """The causal LM and its next-token loss over assistant tokens."""

    def __init__(self, model: Any):
        self.model = model

    def loss(self, batch: dict[str, torch.Tensor], generator: torch.Generator | None = None) -> torch.Tensor:
        # The (vocabulary-wide, so large) logits are computed only at the positions the loss reads:
        # [N, vocab] instead of [batch, length, vocab]. Positions come from the host (see collate).
        hidden = self.model.get_decoder()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                          use_cache=False).last_hidden_state
        picked = hidden.flatten(0, 1).index_select(0, batch["positions"])
        logits = self.model.get_output_embeddings()(picked)
        return torch.nn.functional.cross_entropy(logits.float(), batch["targets"])


# ----------------------------------------------------------------------------------------------


def load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    from ..errors import ImgloraError

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        raise ImgloraError(f"the tokenizer in {model_dir} has no chat template; the llm family trains chat "
                           "models (use an -Instruct / -Chat model, or add a chat_template to tokenizer_config.json)")
    return tokenizer


def pad_id(tokenizer: Any) -> int:
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(tid, int):
            return tid
    return 0


def length_bucket(n: int) -> int:
    return int(math.ceil(n / LENGTH_BUCKET) * LENGTH_BUCKET)


def base_model_name(path: str, model_dir: Path) -> str:
    """What ``adapter_config.json`` names as the base: the hub id as the preset gives it, else the
    resolved local folder (``tiny:llm`` and relative paths mean nothing elsewhere)."""
    from ..models import _looks_like_hub_id

    local = Path(path).expanduser()
    if not path.startswith("tiny:") and not local.exists() and _looks_like_hub_id(path):
        return path
    return str(Path(model_dir).resolve())


def split_conversations(cfg: Any) -> tuple[list[Conversation], list[Conversation], list[str]]:
    """(training, validation, warnings): validation from eval.holdout_file, else a deterministic
    eval.holdout_fraction of data.file (a pure function of train.seed and the file)."""
    from ..data.chat import read_jsonl
    from ..errors import DataError

    warnings: list[str] = []
    convs = read_jsonl(cfg.data.file)
    ev = cfg.eval
    if ev.holdout_file:
        if ev.holdout_fraction:
            warnings.append(f"eval.holdout_file is set, so eval.holdout_fraction = {ev.holdout_fraction:g} is ignored")
        return convs, read_jsonl(ev.holdout_file), warnings
    if not ev.holdout_fraction:
        return convs, [], warnings
    n_held = max(1, round(len(convs) * ev.holdout_fraction))
    if n_held >= len(convs):
        raise DataError([(f"{cfg.data.file}: {len(convs)} conversations are too few to hold out "
                          f"eval.holdout_fraction = {ev.holdout_fraction:g} for validation")])
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
    from ..record import sha256_file

    digest = sha256_file(Path(cfg.data.file))
    if not cfg.eval.holdout_file:
        return digest
    both = f"train:{digest}\nvalidation:{sha256_file(Path(cfg.eval.holdout_file))}\n"
    return hashlib.sha256(both.encode()).hexdigest()


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


# ----------------------------------------------------------------------------------------------
# The evaluation pass (imglora eval): answers of the base model and of base + adapter


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
