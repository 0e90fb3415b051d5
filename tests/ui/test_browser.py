"""``imglora ui`` in a real headless browser (Debian's chromium driven by Playwright's Python API):
the runs page while a tiny run trains (the curve grows), a run started from the form after a bad
value is shown and fixed, Stop (interrupted, resumable), a caption edited, an export into a
ComfyUI-shaped folder. Screenshots of each page go to $IMGLORA_UI_SCREENSHOTS (docs/ui/ in the
repository was made so). Skipped, with the reason, where Playwright or a chromium is missing."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")

from comfy_tree import fake_comfyui  # noqa: E402

from imglora.ui.server import create_app  # noqa: E402

from test_server import PRESETS, _overrides, _root  # noqa: E402 (tests/ui is on sys.path, as for every test folder)

CHROMIUM = next((p for p in (os.environ.get("IMGLORA_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no chromium to drive (apt-get install chromium, or set IMGLORA_CHROMIUM)")
    root = _root(tmp_path_factory.mktemp("browser"))
    fake_comfyui(root / "ComfyUI", "loras")
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(root, presets=PRESETS), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    shots = Path(os.environ.get("IMGLORA_UI_SCREENSHOTS") or tmp_path_factory.mktemp("shots"))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        yield {"root": root, "url": f"http://127.0.0.1:{port}", "page": page, "shots": shots}
        browser.close()
    server.should_exit = True
    thread.join(10)


def _until(fn, timeout: float = 180.0):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = fn()
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError("timed out")


def test_start_from_the_form_watch_the_curve_grow_and_stop(site) -> None:
    page, root = site["page"], site["root"]
    page.goto(site["url"] + "/#new")
    page.select_option("#preset", "tiny-flux.toml")
    page.wait_for_selector('#keys[data-preset="tiny-flux.toml"] [data-key]')  # that preset's values, not the first's
    for override in _overrides(root, "browser", steps=400, every=1000):
        key, value = override.split("=", 1)
        page.fill("#key-filter", key)
        field = f'#keys [data-key="{key}"]'
        kind = page.get_attribute(field, "data-type")
        # a text field takes the text itself (the page quotes it), a number field the number
        page.fill(field, value.strip('"') if kind == "str" else value)
        page.dispatch_event(field, "change")
    # a choice is a list of its values, a boolean true/false, each showing the preset's value beside it
    page.fill("#key-filter", "lora.type")
    assert page.eval_on_selector('#keys select[data-key="lora.type"]', "s => [...s.options].map(o => o.value)") == [
        "", "lora", "dora", "loha", "lokr", "oft"]
    page.select_option('#keys select[data-key="lora.type"]', "lora")
    page.dispatch_event('#keys select[data-key="lora.type"]', "change")
    page.fill("#key-filter", "memory.gradient_checkpointing")
    assert page.get_attribute('#keys [data-key="memory.gradient_checkpointing"]', "data-type") == "bool"
    # the cost of the run on the offers entered, from the plan of each card named
    page.fill("#offers", "runpod-h100:2.99\nvast-4090:0.40:1.5")
    page.click("#btn-estimate")
    page.wait_for_selector("#estimate tr.offer")
    assert page.inner_text('#estimate tr.offer[data-offer="vast-4090"] td.cost') == f"{(400 * 1.5 + 600) / 3600 * 0.40:.2f}"
    assert "predicted for the H100 SXM" in page.inner_text('#estimate tr.offer[data-offer="runpod-h100"]')
    # a bad key first (typed among the other keys): the message and hint `imglora config` gives, nothing started
    page.fill("#extra", "lora.rnak=4")
    page.click("#btn-start")
    page.wait_for_function("document.querySelector('#problems').dataset.ok === 'false'")
    problems = page.inner_text("#problems")
    assert "--set lora.rnak: unknown key (did you mean \"rank\"?)" in problems
    assert not (root / "runs" / "browser").exists()
    page.fill("#extra", "")
    page.evaluate("document.querySelector('#problems').dataset.ok = ''")
    # then a bad value: the same message `imglora config` gives, nothing started
    page.fill("#key-filter", "lora.rank")
    assert page.get_attribute('#keys input[data-key="lora.rank"]', "type") == "number"
    assert page.get_attribute('#keys input[data-key="lora.rank"]', "min") == "1"
    assert page.inner_text('#keys tr:has([data-key="lora.rank"]) td:nth-child(3)') == "8"  # tiny-flux's rank
    page.fill('#keys input[data-key="lora.rank"]', "-4")
    page.dispatch_event('#keys input[data-key="lora.rank"]', "change")
    changed = page.inner_text("#changed")
    assert 'lora.type="lora"' in changed and "lora.rank=-4" in changed and 'run.name="browser"' in changed
    page.click("#btn-start")
    page.wait_for_function("document.querySelector('#problems').dataset.ok === 'false'")
    assert "lora.rank" in page.inner_text("#problems")
    assert not (root / "runs" / "browser").exists()
    page.screenshot(path=str(site["shots"] / "new-run.png"), full_page=True)
    page.fill('#keys input[data-key="lora.rank"]', "4")
    page.dispatch_event('#keys input[data-key="lora.rank"]', "change")
    page.click("#btn-start")
    page.wait_for_function("document.querySelector('#run-name').textContent === 'browser'", timeout=60_000)
    # the curve grows while the run trains (server-sent events)
    page.wait_for_function("Number(document.querySelector('#curve').dataset.points || 0) >= 2", timeout=180_000)
    first = int(page.get_attribute("#curve", "data-points"))
    page.wait_for_function(f"Number(document.querySelector('#curve').dataset.points) > {first}", timeout=120_000)
    assert page.get_attribute("#run-state", "data-state") == "running"
    page.screenshot(path=str(site["shots"] / "runs.png"), full_page=True)
    # Stop: a checkpoint, then interrupted and resumable
    page.click("#btn-stop")
    page.wait_for_function("document.querySelector('#run-state').dataset.state === 'interrupted'", timeout=180_000)
    assert page.is_enabled("#btn-resume") and not page.is_enabled("#btn-stop")
    assert list((root / "runs" / "browser" / "checkpoints").iterdir())


def test_edit_a_caption_and_see_the_masks(site) -> None:
    from PIL import Image

    page, root = site["page"], site["root"]
    (root / "datasets" / "masks").mkdir(exist_ok=True)
    mask = Image.new("L", (512, 512), 40)
    mask.paste(255, (128, 128, 384, 384))
    mask.save(root / "datasets" / "masks" / "01_sky.png")
    page.goto(site["url"] + "/#dataset")
    page.fill("#dataset-dir", "datasets/toy")
    page.fill("#dataset-masks", "datasets/masks")
    page.click("#btn-dataset")
    overlay = page.wait_for_selector('img.mask[src="/files/datasets/masks/01_sky.png"]')
    page.wait_for_function("[...document.querySelectorAll('#gallery img')].every(i => i.complete)")
    assert overlay.evaluate("m => getComputedStyle(m).mixBlendMode") == "multiply"
    assert overlay.evaluate("m => m.naturalWidth") == 512  # it loaded
    page.fill("#overlay", "100")
    page.dispatch_event("#overlay", "input")
    assert overlay.evaluate("m => getComputedStyle(m).opacity") == "1"
    warnings = page.inner_text("#dataset-warnings")
    assert "have no mask in" in warnings and "datasets/masks" in warnings and "02_grass.jpg" in warnings
    box = page.wait_for_selector('textarea[data-image="datasets/toy/02_grass.jpg"]')
    box.fill("sks toy on green grass, edited in the browser")
    box.dispatch_event("change")
    _until(lambda: (root / "datasets/toy/02_grass.txt").read_text() == "sks toy on green grass, edited in the browser\n")
    page.screenshot(path=str(site["shots"] / "dataset.png"), full_page=True)


def test_export_to_a_comfyui_folder(site) -> None:
    page, root = site["page"], site["root"]
    from imglora.commands.common import load_config
    from imglora.commands.train import train

    cwd = os.getcwd()
    os.chdir(root)
    try:  # a finished run to export
        train(load_config(PRESETS / "tiny-flux.toml", _overrides(root, "finished") + ["eval.holdout=1"]),
              out=lambda s: None)
    finally:
        os.chdir(cwd)
    from imglora.commands.evaluate import evaluate

    evaluate(root / "runs" / "finished", all_checkpoints=True, out=lambda s: None)
    page.goto(site["url"] + "/#runs")
    page.click('tr.run[data-name="finished"]')
    # the evaluation: held-out loss per checkpoint, the best marked, its sheet linked
    page.wait_for_selector("#ckpt-losses tr.best")
    best = json.loads((root / "runs/finished/eval/losses.json").read_text())["best_step"]
    assert page.get_attribute("#ckpt-losses tr.best", "data-step") == str(best)
    assert "★ best" in page.inner_text("#ckpt-losses tr.best")
    page.wait_for_function("document.querySelector('#run-state').dataset.state === 'finished'")
    page.fill("#export-comfyui", "ComfyUI")
    page.click("#btn-export")
    page.wait_for_function("document.querySelector('#job').dataset.done === '0'", timeout=120_000)
    assert list((root / "ComfyUI" / "models" / "loras").glob("*.safetensors"))
    assert page.get_attribute("#adapter-link", "href") == "/files/runs/finished/adapter/pytorch_lora_weights.safetensors"
    page.screenshot(path=str(site["shots"] / "export.png"), full_page=True)
