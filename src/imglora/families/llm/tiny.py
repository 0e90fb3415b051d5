"""The tiny chat model (``tiny:llm``): a Qwen2 layout with a byte-level BPE tokenizer and Qwen's
ChatML template, tiny widths, random weights (see ``imglora.models.tiny``)."""

from __future__ import annotations

from pathlib import Path

from ...models.tiny import save_model, seeded, write_json as _write_json

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


_CORPUS = (
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


def write_chat_tokenizer(folder: Path) -> dict[str, int]:
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
    tok.train_from_iterator(_CORPUS, trainer=trainer)
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


def build(dest: Path, seed: int) -> None:
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    ids = write_chat_tokenizer(dest)
    eos, pad = ids["<|im_end|>"], ids["<|endoftext|>"]
    config = Qwen2Config(
        vocab_size=max(ids.values()) + 1,  # the special tokens come last
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
    )
    model = seeded(seed, "model", lambda: Qwen2ForCausalLM(config))
    # Greedy by default (unlike Qwen's sampling defaults) so generation in tests is reproducible.
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    save_model(model, dest)
