"""Tiny random models for tests, demos and dry runs: ``model.path = "tiny:sdxl"`` (or flux, llm).

Every kind is a folder in exactly the on-disk layout of the real model it stands in for, so the
real loading code runs on it unchanged:

* ``tiny:sdxl`` loads with ``StableDiffusionXLPipeline.from_pretrained``. The UNet keeps SDXL's
  topology (3 levels: DownBlock2D then two CrossAttn levels, 2 resnets per level, "text_time"
  conditioning, linear-projection transformers with to_q/to_k/to_v/to_out.0), so adapter key
  names map onto ComfyUI/kohya names exactly as for the real model; only the widths are tiny.
* ``tiny:flux`` loads with ``FluxPipeline.from_pretrained``: 4 double and 8 single transformer
  blocks (enough for block-swap tests), a 16-channel VAE, CLIP + T5 encoders.
* ``tiny:llm`` loads with ``AutoModelForCausalLM`` / ``AutoTokenizer``: a Qwen2 chat model with a
  byte-level BPE tokenizer and Qwen's ChatML chat template.

The weights are random, so outputs are noise: these models exercise shapes, key names, loading,
saving, caching and memory plumbing in seconds on a CPU, never image or text quality. No network is
needed: weights come from ``torch.manual_seed`` and the tokenizers are built here from built-in word
lists. Builds are deterministic (same seed, byte-identical files), take a few seconds and a few MB.

``ensure_tiny(kind)`` builds once into ``$IMGLORA_HOME/tiny/<kind>-v<TINY_VERSION>`` (default
``~/.cache/imglora``); bump ``TINY_VERSION`` whenever the generator changes so stale folders are
never reused.
"""

from __future__ import annotations

import json
import os
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from .atomic import atomic_dir
from .errors import ModelSourceError

TINY_KINDS = ("sdxl", "flux", "llm")
TINY_VERSION = 1

# Written last into a finished build; a folder without a matching one is never trusted.
_MARKER = "imglora_tiny.json"

# Words that tokenize to single tokens (CLIP and T5), so prompts in tests and the captions of
# sample_datasets/sks_toy stay short.
_WORDS = (
    "a", "an", "the", "of", "in", "on", "at", "with", "and", "to", "is", "it", "this", "that",
    "photo", "picture", "painting", "portrait", "style", "sks", "toy", "red", "blue", "green",
    "ball", "dog", "cat", "man", "woman", "person", "table", "background", "white", "black",
    "small", "big", "high", "quality", "detailed", "close", "up", "view", "light", "wooden",
    "striped", "floating", "sky", "grass", "lawn", "front", "brick", "wall", "clouds", "left",
    "right", "behind",
)

# Qwen2-Instruct's chat template, verbatim: ChatML with a default system turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def imglora_home() -> Path:
    """Where imglora keeps generated files: ``$IMGLORA_HOME``, else ``~/.cache/imglora``."""
    env = os.environ.get("IMGLORA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "imglora"


def tiny_dir(kind: str, root: Path | None = None) -> Path:
    """The folder ``ensure_tiny(kind)`` builds into: ``<root or home>/tiny/<kind>-v<TINY_VERSION>``."""
    _check_kind(kind)
    return Path(root if root is not None else imglora_home()) / "tiny" / f"{kind}-v{TINY_VERSION}"


def ensure_tiny(kind: str, root: Path | None = None) -> Path:
    """Return the folder of tiny model ``kind``, building it on first use.

    The build goes to a temporary folder that is renamed into place only once complete, so a crash
    never leaves a folder that a later call trusts. Builders are serialized by a lock file, so a
    process that loses the race waits and then finds the finished folder.
    """
    dest = tiny_dir(kind, root)
    if _is_complete(dest, kind):
        return dest
    with _lock(dest.with_name(f".{dest.name}.lock")):
        if not _is_complete(dest, kind):
            with atomic_dir(dest) as tmp:
                build_tiny(kind, tmp)
    return dest


def build_tiny(kind: str, dest: Path, seed: int = 0) -> None:
    """Write tiny model ``kind`` into ``dest`` (created if needed), weights drawn from ``seed``."""
    _check_kind(kind)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _BUILDERS[kind](dest, seed)
    _write_json(dest / _MARKER, {"kind": kind, "version": TINY_VERSION, "seed": seed})


def _check_kind(kind: str) -> None:
    if kind not in TINY_KINDS:
        valid = ", ".join(f"tiny:{k}" for k in TINY_KINDS)
        raise ModelSourceError(f"unknown tiny model 'tiny:{kind}'; valid names are {valid}")


def _is_complete(folder: Path, kind: str) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return marker.get("kind") == kind and marker.get("version") == TINY_VERSION


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path``, held for the ``with`` block (waits for it)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_json(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _seeded(seed: int, component: str, make: Callable[[], Any]) -> Any:
    """Construct one component from its own seed, so components never share weights by accident
    and adding one does not change the others."""
    import torch

    torch.manual_seed(seed * 1_000_003 + zlib.crc32(component.encode()))
    return make()


def _save_model(model: Any, folder: Path) -> None:
    model.save_pretrained(folder, safe_serialization=True)


# --- tokenizers ------------------------------------------------------------------------------------
# Written as the files the real repositories ship, not as whatever this transformers version's
# save_pretrained writes, so loading them exercises the same path as loading the real ones.


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible byte -> printable character map used by byte-level BPE, in its order
    (printable bytes as themselves, then the rest shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _bpe(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply BPE merges the way ``tokenizers`` does: lowest rank first, leftmost on ties."""
    while len(pieces) > 1:
        rank, i = min((ranks.get(pair, len(ranks)), i) for i, pair in enumerate(zip(pieces, pieces[1:])))
        if rank == len(ranks):
            break
        pieces[i:i + 2] = [pieces[i] + pieces[i + 1]]
    return pieces


def _write_clip_tokenizer(folder: Path, pad_token: str) -> int:
    """CLIP's layout: vocab.json + merges.txt, then config files; returns the vocab size.

    As in CLIP, ids 0-255 are the byte characters, 256-511 the same with ``</w>`` (end of word),
    then one token per merge, and the two special tokens last, so ``<|endoftext|>`` has the highest
    id (CLIP's pooled output relies on that). Merges are added until every word in ``_WORDS`` is
    one token; a new merge ranks after all earlier ones, so it never splits an earlier word.
    """
    alphabet = list(_bytes_to_unicode().values())
    ranks: dict[tuple[str, str], int] = {}
    for word in _WORDS:
        while len(pieces := _bpe([*word[:-1], word[-1] + "</w>"], ranks)) > 1:
            ranks[(pieces[0], pieces[1])] = len(ranks)
    merges = [f"{a} {b}" for a, b in ranks]
    tokens = alphabet + [c + "</w>" for c in alphabet] + [a + b for a, b in ranks]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}  # two merges may spell one token

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    special = {"bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
               "unk_token": "<|endoftext|>", "pad_token": pad_token}
    _write_json(folder / "special_tokens_map.json", special)
    _write_json(folder / "tokenizer_config.json", {
        **special, "add_prefix_space": False, "do_lower_case": True, "errors": "replace",
        "model_max_length": 77, "tokenizer_class": "CLIPTokenizer",
    })
    return len(vocab)


def _write_t5_tokenizer(folder: Path) -> int:
    """T5's layout (a Unigram tokenizer.json; no spiece.model, which needs sentencepiece to build).

    Ids as in T5: ``<pad>``=0, ``</s>``=1, ``<unk>``=2, pieces, then 100 sentinels in reverse order.
    Pieces are every printable ASCII char (alone and word-initial ``▁c``) and each of ``_WORDS``;
    whole words score above any split, so they stay single tokens. Returns the vocab size.
    """
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import Unigram

    chars = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [(c, -10.0) for c in chars] + [("▁" + c, -11.0) for c in chars]
    pieces += [("▁" + w, -5.0) for w in _WORDS if len(w) > 1]
    sentinels = [f"<extra_id_{i}>" for i in range(100)]
    pieces += [(s, 0.0) for s in reversed(sentinels)]

    # The same pipeline transformers' T5Tokenizer builds, so v4 (which uses tokenizer.json as is)
    # and v5 (which rebuilds the pipeline around the vocab) tokenize identically.
    tok = Tokenizer(Unigram(pieces, unk_id=2, byte_fallback=False))
    metaspace = dict(replacement="▁", prepend_scheme="always", split=True)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(**metaspace)])
    tok.decoder = decoders.Metaspace(**metaspace)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    tok.add_special_tokens(["<pad>", "</s>", "<unk>", *sentinels])

    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    special = {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
               "additional_special_tokens": sentinels}
    _write_json(folder / "special_tokens_map.json", special)
    _write_json(folder / "tokenizer_config.json", {
        **special, "extra_ids": 100, "legacy": True, "model_max_length": 512,
        "clean_up_tokenization_spaces": True, "tokenizer_class": "T5Tokenizer",
    })
    return len(pieces)


_LLM_CORPUS = (
    "You are a helpful assistant. Answer the question briefly and clearly.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "What is the capital of France? The capital of France is Paris.",
    "Write a short poem about the sea. The sea is blue, the waves are white, the gulls fly high.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    "User: hello! Assistant: Hello, how can I help you today?",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Punctuation: , . ; : ! ? ' \" ( ) [ ] { } - _ / \\ @ # $ % & * + = < > | ~ ^ `",
    "A LoRA adapter trains a low-rank update on top of frozen model weights.",
    "Please summarize this text in one sentence. Thank you for your help.",
    "system user assistant message content role question answer",
)


def _write_llm_tokenizer(folder: Path) -> dict[str, int]:
    """Qwen2's layout: byte-level BPE (tokenizer.json + vocab.json + merges.txt) with the special
    tokens appended after the BPE vocab, as Qwen does. Returns the special tokens' ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    # Qwen2's pre-tokenizer regex; same pipeline as transformers' Qwen2Tokenizer (see T5 above).
    split = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
             r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=512, min_frequency=1, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_LLM_CORPUS, trainer=trainer)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    ids = {s: tok.token_to_id(s) for s in specials}

    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    tok.model.save(str(folder))  # vocab.json + merges.txt
    added = {str(ids[s]): {"content": s, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": True} for s in specials}
    _write_json(folder / "tokenizer_config.json", {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 2048,
        "pad_token": "<|endoftext|>", "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    })
    return ids


# --- models ------------------------------------------------------------------------------------


def _clip_text_config(vocab_size: int, **kw: Any) -> Any:
    from transformers import CLIPTextConfig

    # bos 0 / eos 2 / pad 1 are the (legacy) ids in the real SDXL and FLUX text-encoder configs:
    # eos_token_id == 2 makes CLIP pool at the highest token id, our <|endoftext|>.
    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=77, bos_token_id=0, eos_token_id=2,
                          pad_token_id=1, **kw)


def _vae(latent_channels: int, **kw: Any) -> Any:
    from diffusers import AutoencoderKL

    # 4 levels like the real VAE, so images are downsampled by 8 (the pipelines derive it this way).
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
                         sample_size=64, force_upcast=True, **kw)


def _write_model_index(dest: Path, pipeline: str, components: dict[str, tuple[str, str]],
                       **extra: Any) -> None:
    import diffusers

    _write_json(dest / "model_index.json", {
        "_class_name": pipeline, "_diffusers_version": diffusers.__version__, **extra,
        **{name: list(lib_cls) for name, lib_cls in sorted(components.items())},
    })


def _build_sdxl(dest: Path, seed: int) -> None:
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    vocab = _write_clip_tokenizer(dest / "tokenizer", pad_token="<|endoftext|>")
    _write_clip_tokenizer(dest / "tokenizer_2", pad_token="!")
    te1 = _clip_text_config(vocab, hidden_act="quick_gelu")  # CLIP ViT-L
    te2 = _clip_text_config(vocab, hidden_act="gelu", projection_dim=32)  # OpenCLIP bigG
    _save_model(_seeded(seed, "text_encoder", lambda: CLIPTextModel(te1)), dest / "text_encoder")
    _save_model(_seeded(seed, "text_encoder_2", lambda: CLIPTextModelWithProjection(te2)),
                dest / "text_encoder_2")

    time_dim = 8
    unet = _seeded(seed, "unet", lambda: UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
        block_out_channels=(16, 32, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        attention_head_dim=(1, 2, 2),  # SDXL's key, which diffusers reads as the number of heads
        transformer_layers_per_block=(1, 1, 2), use_linear_projection=True, norm_num_groups=8,
        # SDXL attends to both encoders' penultimate hidden states, concatenated.
        cross_attention_dim=te1.hidden_size + te2.hidden_size,
        # 6 micro-conditioning numbers (sizes, crop), each embedded, plus te2's pooled projection.
        addition_embed_type="text_time", addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=6 * time_dim + te2.projection_dim,
    ))
    _save_model(unet, dest / "unet")
    _save_model(_seeded(seed, "vae", lambda: _vae(4, scaling_factor=0.13025)), dest / "vae")
    EulerDiscreteScheduler(
        num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
        prediction_type="epsilon", interpolation_type="linear", use_karras_sigmas=False,
        timestep_spacing="leading", steps_offset=1,
    ).save_pretrained(dest / "scheduler")
    _write_model_index(dest, "StableDiffusionXLPipeline", {
        "scheduler": ("diffusers", "EulerDiscreteScheduler"),
        "text_encoder": ("transformers", "CLIPTextModel"),
        "text_encoder_2": ("transformers", "CLIPTextModelWithProjection"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "tokenizer_2": ("transformers", "CLIPTokenizer"),
        "unet": ("diffusers", "UNet2DConditionModel"),
        "vae": ("diffusers", "AutoencoderKL"),
    }, force_zeros_for_empty_prompt=True, add_watermarker=None)


def _build_flux(dest: Path, seed: int) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5Config, T5EncoderModel

    clip_vocab = _write_clip_tokenizer(dest / "tokenizer", pad_token="<|endoftext|>")
    t5_vocab = _write_t5_tokenizer(dest / "tokenizer_2")
    clip = _clip_text_config(clip_vocab, hidden_act="quick_gelu")
    # T5 v1.1 style (gated GELU, untied, relative position buckets) like FLUX's T5-XXL encoder.
    t5 = T5Config(vocab_size=t5_vocab, d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2,
                  feed_forward_proj="gated-gelu", tie_word_embeddings=False, is_encoder_decoder=False,
                  use_cache=False)
    _save_model(_seeded(seed, "text_encoder", lambda: CLIPTextModel(clip)), dest / "text_encoder")
    _save_model(_seeded(seed, "text_encoder_2", lambda: T5EncoderModel(t5)), dest / "text_encoder_2")

    transformer = _seeded(seed, "transformer", lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=64,  # 16 latent channels packed 2x2
        num_layers=4, num_single_layers=8, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=t5.d_model, pooled_projection_dim=clip.hidden_size,
        guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
        axes_dims_rope=(4, 6, 6),  # sums to attention_head_dim
    ))
    _save_model(transformer, dest / "transformer")
    vae = _seeded(seed, "vae", lambda: _vae(16, scaling_factor=0.3611, shift_factor=0.1159,
                                            use_quant_conv=False, use_post_quant_conv=False))
    _save_model(vae, dest / "vae")
    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=256, max_image_seq_len=4096,
    ).save_pretrained(dest / "scheduler")
    _write_model_index(dest, "FluxPipeline", {
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "CLIPTextModel"),
        "text_encoder_2": ("transformers", "T5EncoderModel"),
        "tokenizer": ("transformers", "CLIPTokenizer"),
        "tokenizer_2": ("transformers", "T5TokenizerFast"),
        "transformer": ("diffusers", "FluxTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKL"),
    })


def _build_llm(dest: Path, seed: int) -> None:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    ids = _write_llm_tokenizer(dest)
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen2Config(
        vocab_size=max(ids.values()) + 1,  # the special tokens come last
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
    )
    model = _seeded(seed, "model", lambda: Qwen2ForCausalLM(config))
    # Greedy by default (unlike Qwen's sampling defaults) so generation in tests is reproducible.
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    _save_model(model, dest)


_BUILDERS: dict[str, Callable[[Path, int], None]] = {
    "sdxl": _build_sdxl, "flux": _build_flux, "llm": _build_llm,
}
