"""Pieces of the tiny diffusers image models (SDXL, FLUX): tokenizers and components built the way
the real repositories ship them. See ``imglora.models.tiny`` for what tiny models are for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...models.tiny import write_json as _write_json

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


def write_clip_tokenizer(folder: Path, pad_token: str) -> int:
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


def write_t5_tokenizer(folder: Path) -> int:
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


# Qwen2's pre-tokenizer split (its tokenizer.json), then byte-level BPE.
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2.5-VL's special tokens in their order (ids after the vocabulary, as the real tokenizer has them).
QWEN2_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def write_qwen2_tokenizer(folder: Path, words: tuple[str, ...] = ()) -> int:
    """Qwen2's layout (vocab.json + merges.txt + tokenizer.json + tokenizer_config.json): byte-level
    BPE whose merges make each of ``_WORDS`` and ``words`` one token, alone and after a space (``Ġ``),
    then Qwen2.5-VL's special tokens. A chat template's words given in ``words`` tokenize as the real
    tokenizer cuts them (e.g. Qwen-Image's template prefix is 34 tokens, as with the real one).
    Returns the vocab size, special tokens included."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    b2u = _bytes_to_unicode()
    space = b2u[ord(" ")]
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys([*_WORDS, *words]):
        for form in (word, space + word):
            while len(pieces := _bpe(list(form), ranks)) > 1:
                ranks[(pieces[0], pieces[1])] = len(ranks)
    vocab = {t: i for i, t in enumerate(dict.fromkeys([b2u[b] for b in range(256)] + [a + b for a, b in ranks]))}
    tok = Tokenizer(BPE(vocab=vocab, merges=list(ranks), byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(QWEN2_SPECIAL))

    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(f"{a} {b}" for a, b in ranks) + "\n",
                                       encoding="utf-8")
    added = {str(len(vocab) + i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                   "single_word": False, "special": True} for i, t in enumerate(QWEN2_SPECIAL)}
    _write_json(folder / "tokenizer_config.json", {
        "add_prefix_space": False, "added_tokens_decoder": added, "additional_special_tokens": list(QWEN2_SPECIAL[1:]),
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "errors": "replace", "model_max_length": 131072, "split_special_tokens": False,
        "clean_up_tokenization_spaces": False, "tokenizer_class": "Qwen2Tokenizer",
    })
    return len(vocab) + len(QWEN2_SPECIAL)


# Qwen3's chat template, as far as the pipelines use it (Z-Image, FLUX.2 [klein]): the messages, the
# generation prompt, and the empty think block only when enable_thinking is false.
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}")


def write_qwen3_tokenizer(folder: Path, words: tuple[str, ...] = ()) -> int:
    """Qwen2's tokenizer files (:func:`write_qwen2_tokenizer`) with Qwen3's chat template; the vocab size."""
    vocab = write_qwen2_tokenizer(folder, words)
    config = folder / "tokenizer_config.json"
    _write_json(config, {**json.loads(config.read_text()), "chat_template": QWEN3_CHAT_TEMPLATE})
    return vocab

# --- models ------------------------------------------------------------------------------------


def clip_text_config(vocab_size: int, **kw: Any) -> Any:
    from transformers import CLIPTextConfig

    # bos 0 / eos 2 / pad 1 are the (legacy) ids in the real SDXL and FLUX text-encoder configs:
    # eos_token_id == 2 makes CLIP pool at the highest token id, our <|endoftext|>.
    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=77, bos_token_id=0, eos_token_id=2,
                          pad_token_id=1, **kw)


def vae(latent_channels: int, **kw: Any) -> Any:
    from diffusers import AutoencoderKL

    # 4 levels like the real VAE, so images are downsampled by 8 (the pipelines derive it this way).
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=latent_channels,
                         down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=(16, 32, 32, 32), layers_per_block=1, norm_num_groups=8,
                         sample_size=64, force_upcast=True, **kw)


def write_model_index(dest: Path, pipeline: str, components: dict[str, tuple[str, str]],
                       **extra: Any) -> None:
    import diffusers

    _write_json(dest / "model_index.json", {
        "_class_name": pipeline, "_diffusers_version": diffusers.__version__, **extra,
        **{name: list(lib_cls) for name, lib_cls in sorted(components.items())},
    })


