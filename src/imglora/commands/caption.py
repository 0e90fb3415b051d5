"""``imglora caption DIR``: a caption ``.txt`` beside each image that has none, from a vision-language model.

Data is best prepared before a GPU is rented, so the default captioner is small enough for a laptop
CPU: SmolVLM-256M-Instruct (Hugging Face, Apache-2.0, 256M parameters, Idefics3 in transformers).
Any instruction-following vision-language model transformers loads with
``AutoModelForImageTextToText`` and whose processor has a chat template takes its place by hub id
or folder (``--model``): Qwen2-VL / Qwen2.5-VL (ai-toolkit's captioner), SmolVLM, Idefics3, LLaVA
and the like. Weights load through safetensors only.

The images are found as training finds them (the folder and its ``<repeats>_<name>`` subfolders,
``.png``/``.jpg``/``.jpeg``/``.webp``); an image whose caption file is missing or empty is
captioned, one with a caption is left alone unless ``--overwrite``. Captions are generated in
batches (greedy decoding: the same image gives the same caption), cleaned (one line; for tags
deduplicated and comma-separated), prefixed with ``--trigger``, and written to a temporary name and
renamed. An image that cannot be read is named and skipped. Progress: images done, seconds per
image, time left. At the end the dataset scan's warnings for the folder are printed (crops,
upscales, shared captions, images still without a caption).
"""

from __future__ import annotations

import inspect
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..util import atomic
from ..errors import DataError, ImgloraError, ModelSourceError

DEFAULT_MODEL = "HuggingFaceTB/SmolVLM-256M-Instruct"
PROMPTS = {
    "natural": ("Describe this image for a text-to-image training caption in one or two plain sentences: the "
                "main subject, its appearance and pose, the setting, the lighting and the style. Start with the "
                "subject; no preamble."),
    "tags": ("List comma-separated tags for this image: subject, clothing, pose, setting, lighting, style, "
             "colors. Only the tags."),
}
MAX_NEW_TOKENS = {"natural": 96, "tags": 64}


@dataclass
class Captioner:
    model: Any
    processor: Any
    device: Any
    dtype: Any
    name: str


def load(model_id: str, device: str = "auto") -> Captioner:
    """The model and its processor (a local folder, or a hub id: downloaded unless offline)."""
    import torch
    from transformers import AutoModelForImageTextToText

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    try:
        model = AutoModelForImageTextToText.from_pretrained(model_id, dtype=dtype, use_safetensors=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelSourceError(f"--model {model_id}: cannot load it as a vision-language model with "
                               f"transformers' AutoModelForImageTextToText and .safetensors weights "
                               f"({type(exc).__name__}: {str(exc).splitlines()[0][:300]})") from None
    processor = load_processor(model_id)
    if not getattr(processor, "chat_template", None):
        raise ModelSourceError(f"--model {model_id}: its processor has no chat template; imglora caption prompts "
                               "instruction-following vision-language models (SmolVLM, Qwen2.5-VL, ...)")
    tok = getattr(processor, "tokenizer", None)
    if tok is not None:
        tok.padding_side = "left"  # batched generation continues each prompt at its end
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
    model.to(dev).eval()
    return Captioner(model, processor, dev, dtype, model_id)


def load_processor(model_id: str) -> Any:
    """``AutoProcessor``; where transformers would also build a video processor that needs
    torchvision (Qwen2-VL's), the same processor class with its image processor and tokenizer alone
    (captions never pass videos)."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(model_id)
    except ImportError as exc:
        if "torchvision" not in str(exc).lower():
            raise
    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer

    config = _processor_config(model_id)
    cls = getattr(transformers, config.get("processor_class", ""), None)
    if cls is None:
        raise ModelSourceError(f"--model {model_id}: its processor needs torchvision, and no processor_class is "
                               "named to build it without; pip install torchvision")
    template = _chat_template(model_id)
    image, tok = AutoImageProcessor.from_pretrained(model_id), AutoTokenizer.from_pretrained(model_id)
    if "video_processor" not in inspect.signature(cls.__init__).parameters:
        return cls(image, tok, chat_template=template)

    class ImageTextProcessor(cls):  # the class without its video processor (as the Qwen-Image-Edit family does)
        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None,
                     **kwargs: Any):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return ImageTextProcessor(image, tok, chat_template=template)


def _local_or_cached(model_id: str, name: str) -> Path | None:
    folder = Path(model_id).expanduser()
    if folder.is_dir():
        return folder / name if (folder / name).is_file() else None
    from huggingface_hub import try_to_load_from_cache

    got = try_to_load_from_cache(model_id, name)
    return Path(got) if isinstance(got, str) else None


def _processor_config(model_id: str) -> dict[str, Any]:
    for name in ("processor_config.json", "preprocessor_config.json"):
        path = _local_or_cached(model_id, name)
        if path is not None:
            data = json.loads(path.read_text())
            if "processor_class" in data:
                return data
    return {}


def _chat_template(model_id: str) -> str | None:
    path = _local_or_cached(model_id, "chat_template.jinja")
    if path is not None:
        return path.read_text()
    path = _local_or_cached(model_id, "chat_template.json")
    if path is not None:
        return json.loads(path.read_text()).get("chat_template")
    return None


def clean(text: str, style: str, trigger: str) -> str:
    """One line; tags deduplicated and comma-separated; the trigger word first (not repeated)."""
    text = "".join(ch if ch.isprintable() else " " for ch in text)  # no control characters in a caption file
    text = " ".join(text.split()).strip(" \"'")
    if style == "tags":
        seen: list[str] = []
        for tag in re.split(r"\s*,\s*", text):
            tag = tag.strip(" .").lower()
            if tag and tag not in seen:
                seen.append(tag)
        text = ", ".join(seen)
    trigger = trigger.strip()
    if trigger and text and not text.lower().startswith(trigger.lower()):
        text = f"{trigger}, {text}"
    return text


def generate(c: Captioner, images: list[Any], prompt: str, max_new_tokens: int) -> list[str]:
    """One caption per image (greedy decoding)."""
    import torch

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    text = c.processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = c.processor(text=[text] * len(images), images=[[im] for im in images], return_tensors="pt",
                         padding=True)
    inputs = {k: (v.to(c.device, c.dtype) if v.is_floating_point() else v.to(c.device)) for k, v in inputs.items()
              if hasattr(v, "to")}
    with torch.inference_mode():
        out = c.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    new = out[:, inputs["input_ids"].shape[1]:]
    return [t.strip() for t in c.processor.batch_decode(new, skip_special_tokens=True)]


@dataclass
class Result:
    written: list[Path]
    skipped: list[Path]  # had a caption
    failed: list[str]  # images that could not be read, or got an empty caption
    warnings: tuple[str, ...]


def caption_folder(folder: str | Path, *, model: str = DEFAULT_MODEL, trigger: str = "", style: str = "natural",
                   overwrite: bool = False, batch_size: int = 4, caption_ext: str = ".txt", prompt: str = "",
                   max_new_tokens: int = 0, resolution: int = 1024, device: str = "auto",
                   captioner: Captioner | None = None, out: Callable[[str], None] = print) -> Result:
    from PIL import Image

    from ..data.dataset import _find_images, scan_dataset

    root = Path(folder).expanduser()
    if style not in PROMPTS:
        raise ImgloraError(f"--style {style!r}: one of {', '.join(PROMPTS)}")
    if not caption_ext.startswith("."):
        caption_ext = "." + caption_ext
    warnings: list[str] = []
    images = [p for p, _ in _find_images(root, 1, warnings, "DIR")]
    todo, skipped = [], []
    for image in images:
        cap = image.with_suffix(caption_ext)
        has = cap.is_file() and cap.read_text(encoding="utf-8-sig", errors="replace").strip()
        (skipped if has and not overwrite else todo).append(image)
    out(f"{root}: {len(images)} images; " + (f"{len(todo)} to caption (--overwrite: every image)" if overwrite else
                                            f"{len(skipped)} with a caption (kept), {len(todo)} to caption"))
    written: list[Path] = []
    failed: list[str] = []
    if todo:
        c = captioner or load(model, device)
        out(f"captioner: {c.name} on {c.device.type} ({str(c.dtype).removeprefix('torch.')}), style {style}")
        text_prompt = prompt or PROMPTS[style]
        limit = max_new_tokens or MAX_NEW_TOKENS[style]
        t0 = time.perf_counter()
        done = 0
        for i in range(0, len(todo), batch_size):
            batch, pics = [], []
            for path in todo[i:i + batch_size]:
                try:
                    with Image.open(path) as im:
                        pics.append(im.convert("RGB"))
                    batch.append(path)
                except (OSError, ValueError) as exc:
                    failed.append(f"{path}: cannot read the image ({exc}); skipped")
            if batch:
                for path, raw in zip(batch, generate(c, pics, text_prompt, limit)):
                    text = clean(raw, style, trigger)
                    if not text:
                        failed.append(f"{path}: the captioner returned nothing; no caption written")
                        continue
                    atomic.write_text(path.with_suffix(caption_ext), text + "\n")
                    written.append(path)
            done += len(todo[i:i + batch_size])
            spent = time.perf_counter() - t0
            per = spent / done
            out(f"captioned {done}/{len(todo)}: {per:.2f} s/image, about {per * (len(todo) - done):.0f} s left")
    for line in failed:
        out(f"warning: {line}")
    try:
        scanned = scan_dataset(root, resolution=resolution, step=64, caption_ext=caption_ext,
                               missing_caption="default", trigger_word=trigger, skip_bad_images=True,
                               dir_key="DIR").warnings
    except DataError as exc:
        scanned = tuple(exc.problems)
    for line in scanned:
        out(f"scan: {line}")
    out(f"wrote {len(written)} caption(s); kept {len(skipped)}; {len(failed)} problem(s)")
    return Result(written, skipped, failed, tuple(scanned))
