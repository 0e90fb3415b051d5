"""``imglora caption``: captions from a tiny random Qwen2.5-VL captioner built offline in the real
format (the tiny Qwen-Image-Edit text encoder, which is a whole Qwen2.5-VL with its LM head, and its
processor, plus a Qwen2-VL chat template)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from imglora.commands import caption
from imglora.models import tiny
from imglora.cli import main
from imglora.errors import ModelSourceError
from imglora.families import registry

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for c in message['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_captioner(tmp_path_factory) -> Path:
    src = tiny.ensure_tiny(registry.get("qwen_image_edit"))
    dest = tmp_path_factory.mktemp("captioner") / "tiny-qwen2.5-vl"
    dest.mkdir()
    for part in ("text_encoder", "processor"):
        for f in (src / part).iterdir():
            shutil.copy(f, dest / f.name)
    (dest / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return dest


@pytest.fixture(scope="module")
def loaded(tiny_captioner) -> caption.Captioner:
    return caption.load(str(tiny_captioner), "cpu")


def _image(path: Path, seed: int, size: tuple[int, int] = (80, 64)) -> Path:
    rng = np.random.RandomState(seed)
    Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8")).save(path)
    return path


def test_clean_makes_one_line_dedupes_tags_and_puts_the_trigger_first() -> None:
    assert caption.clean(' "A red\nbarn  at dusk.\x7f" ', "natural", "") == "A red barn at dusk."
    assert caption.clean("Red, barn, red , Dusk., , sky", "tags", "sks") == "sks, red, barn, dusk, sky"
    assert caption.clean("sks barn", "natural", "sks") == "sks barn"  # not repeated
    assert caption.clean("   ", "natural", "sks") == ""  # nothing: no caption of the trigger alone


def test_the_processor_is_built_without_a_video_processor_where_transformers_needs_torchvision(loaded) -> None:
    from transformers import Qwen2VLProcessor

    assert isinstance(loaded.processor, Qwen2VLProcessor) and loaded.processor.chat_template == CHAT_TEMPLATE
    assert loaded.processor.tokenizer.padding_side == "left" and loaded.device.type == "cpu"


def test_batches_caption_as_single_images_do(loaded, tmp_path) -> None:
    images = [Image.open(_image(tmp_path / f"{i}.png", i)).convert("RGB") for i in range(3)]
    together = caption.generate(loaded, images, caption.PROMPTS["natural"], 10)
    alone = [caption.generate(loaded, [im], caption.PROMPTS["natural"], 10)[0] for im in images]
    assert together == alone and all(together)  # greedy decoding: the same image, the same caption


def test_caption_folder_writes_the_missing_captions_only(loaded, tmp_path) -> None:
    root = tmp_path / "data"
    (root / "5_subject").mkdir(parents=True)
    a, b = _image(root / "a.png", 1), _image(root / "b.jpg", 2)
    c = _image(root / "5_subject" / "c.png", 3, (96, 64))
    (root / "b.txt").write_text("kept as it is\n")
    (root / "a.txt").write_text("  \n")  # empty: captioned
    (root / "broken.png").write_bytes(b"\x89PNG\r\n not an image")
    lines: list[str] = []
    r = caption.caption_folder(root, captioner=loaded, trigger="sks", batch_size=2, out=lines.append)
    assert sorted(r.written) == sorted([a, c]) and r.skipped == [b]
    assert r.failed == [f"{root / 'broken.png'}: cannot read the image (cannot identify image file "
                        f"{str(root / 'broken.png')!r}); skipped"]
    for image in (a, c):
        text = image.with_suffix(".txt").read_text()
        assert text.startswith("sks, ") and text.endswith("\n") and "\n" not in text[:-1]
    assert (root / "b.txt").read_text() == "kept as it is\n"
    assert lines[0] == f"{root}: 4 images; 1 with a caption (kept), 3 to caption"
    assert lines[1] == f"captioner: {loaded.name} on cpu (float32), style natural"
    assert lines[2].startswith("captioned 2/3: ") and lines[3].startswith("captioned 3/3: ") and "s left" in lines[3]
    assert any(line.startswith("scan: ") and "broken.png" in line for line in lines)  # the scan's own warnings
    assert lines[-1] == "wrote 2 caption(s); kept 1; 1 problem(s)"
    assert not [p for p in root.rglob("*") if "tmp" in p.name]
    # again, without the broken file: nothing left to caption, and the model is not even loaded
    (root / "broken.png").unlink()
    lines.clear()
    r2 = caption.caption_folder(root, captioner=None, model="no/such-model", out=lines.append)
    assert r2.written == [] and lines[0] == f"{root}: 3 images; 3 with a caption (kept), 0 to caption"


def test_overwrite_replaces_with_the_same_caption_and_tags_style(loaded, tmp_path) -> None:
    root = tmp_path / "d"
    root.mkdir()
    a = _image(root / "a.png", 5)
    caption.caption_folder(root, captioner=loaded, out=lambda s: None)
    first = a.with_suffix(".txt").read_text()
    caption.caption_folder(root, captioner=loaded, overwrite=True, out=lambda s: None)
    assert a.with_suffix(".txt").read_text() == first
    caption.caption_folder(root, captioner=loaded, overwrite=True, style="tags", trigger="sks", out=lambda s: None)
    tags = a.with_suffix(".txt").read_text().strip().split(", ")
    assert tags[0] == "sks" and len(tags) == len(set(tags))


def test_cli_end_to_end_and_its_errors(tiny_captioner, tmp_path) -> None:
    root = tmp_path / "cli"
    root.mkdir()
    _image(root / "x.png", 7)
    r = CliRunner().invoke(main, ["caption", str(root), "--model", str(tiny_captioner), "--device", "cpu",
                                  "--max-new-tokens", "8", "--caption-ext", "caption"])
    assert r.exit_code == 0, r.output
    assert (root / "x.caption").read_text().strip() and "wrote 1 caption(s); kept 0; 0 problem(s)" in r.output
    r = CliRunner().invoke(main, ["caption", str(tmp_path / "nowhere")])
    assert r.exit_code != 0 and "the dataset folder does not exist; check DIR" in r.output
    assert "Traceback" not in r.output
    help_ = CliRunner().invoke(main, ["caption", "--help"]).output
    assert "SmolVLM-256M-Instruct" in help_ and "--overwrite" in help_ and "--trigger" in help_


def test_a_model_without_a_chat_template_is_refused(tiny_captioner, tmp_path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tiny_captioner, plain)
    (plain / "chat_template.jinja").unlink()
    with pytest.raises(ModelSourceError, match="its processor has no chat template"):
        caption.load(str(plain), "cpu")
    with pytest.raises(ModelSourceError, match=r"--model .*: cannot load it as a vision-language model"):
        caption.load(str(tmp_path / "missing-model"), "cpu")
