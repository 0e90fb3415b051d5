"""``imglora ui`` in a real headless browser (Debian's chromium driven by Playwright's Python API):
the runs page while a tiny run trains (the curve grows), a run started from the form after a bad
value is shown and fixed, Stop (interrupted, resumable), a caption edited, an export into a
ComfyUI-shaped folder; and the attacks of issue 41 as they were found: a form on another port of
127.0.0.1 posting to the UI (CSRF), a foreign Host name resolved to 127.0.0.1 (DNS rebinding), and
markup planted in every field the page shows (stored XSS). The server asks a token, as by default,
and the browser logs in the way a user does: by opening the URL ``imglora ui`` prints. Screenshots
of each page go to $IMGLORA_UI_SCREENSHOTS (docs/ui/ in the repository was made so). Skipped, with
the reason, where Playwright or a chromium is missing."""

from __future__ import annotations

import functools
import http.server
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

from imglora.ui.server import create_app, ui_url  # noqa: E402

from test_server import PRESETS, _overrides, _root  # noqa: E402 (tests/ui is on sys.path, as for every test folder)

CHROMIUM = next((p for p in (os.environ.get("IMGLORA_CHROMIUM"), shutil.which("chromium"),
                             shutil.which("chromium-browser"), shutil.which("google-chrome")) if p), None)


TOKEN = "browser-token-41"
EVIL = "evil.example"  # resolved to 127.0.0.1 inside the browser only (--host-resolver-rules)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, port


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    if CHROMIUM is None:
        pytest.skip("no chromium to drive (apt-get install chromium, or set IMGLORA_CHROMIUM)")
    root = _root(tmp_path_factory.mktemp("browser"))
    fake_comfyui(root / "ComfyUI", "loras")
    app = create_app(root, TOKEN, PRESETS)
    server, thread, port = _serve(app)
    shots = Path(os.environ.get("IMGLORA_UI_SCREENSHOTS") or tmp_path_factory.mktemp("shots"))
    shots.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", f"--host-resolver-rules=MAP {EVIL} 127.0.0.1"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        opened = page.goto(ui_url("127.0.0.1", port, TOKEN))  # the URL `imglora ui` prints
        assert opened.status == 200 and page.url == f"http://127.0.0.1:{port}/"  # logged in, the token gone
        yield {"root": root, "url": f"http://127.0.0.1:{port}", "page": page, "shots": shots, "app": app,
               "port": port, "browser": browser}
        browser.close()
    server.should_exit = True
    thread.join(10)


def _until(fn, timeout: float = 180.0, every: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise AssertionError("timed out")


def _js_until(page, expression: str, timeout: float = 30.0):
    """Wait until ``expression`` is true in the page. Polled through page.evaluate: Playwright's
    wait_for_function compiles its predicate with eval, which the page's Content-Security-Policy
    (script-src 'self') forbids, as it should."""
    try:
        return _until(lambda: page.evaluate(expression), timeout, 0.1)
    except AssertionError:
        raise AssertionError(f"timed out after {timeout} s waiting for {expression}") from None


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
    _js_until(page, "document.querySelector('#problems').dataset.ok === 'false'")
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
    _js_until(page, "document.querySelector('#problems').dataset.ok === 'false'")
    assert "lora.rank" in page.inner_text("#problems")
    assert not (root / "runs" / "browser").exists()
    page.screenshot(path=str(site["shots"] / "new-run.png"), full_page=True)
    page.fill('#keys input[data-key="lora.rank"]', "4")
    page.dispatch_event('#keys input[data-key="lora.rank"]', "change")
    page.click("#btn-start")
    _js_until(page, "document.querySelector('#run-name').textContent === 'browser'", 60)
    # the curve grows while the run trains (server-sent events)
    _js_until(page, "Number(document.querySelector('#curve').dataset.points || 0) >= 2", 180)
    first = int(page.get_attribute("#curve", "data-points"))
    _js_until(page, f"Number(document.querySelector('#curve').dataset.points) > {first}", 120)
    assert page.get_attribute("#run-state", "data-state") == "running"
    page.screenshot(path=str(site["shots"] / "runs.png"), full_page=True)
    # Stop: a checkpoint, then interrupted and resumable
    page.click("#btn-stop")
    _js_until(page, "document.querySelector('#run-state').dataset.state === 'interrupted'", 180)
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
    _js_until(page, "[...document.querySelectorAll('#gallery img')].every(i => i.complete)")
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
    _js_until(page, "document.querySelector('#run-state').dataset.state === 'finished'")
    page.fill("#export-comfyui", "ComfyUI")
    page.click("#btn-export")
    _js_until(page, "document.querySelector('#job').dataset.done === '0'", 120)
    assert list((root / "ComfyUI" / "models" / "loras").glob("*.safetensors"))
    assert page.get_attribute("#adapter-link", "href") == "/files/runs/finished/adapter/pytorch_lora_weights.safetensors"
    page.screenshot(path=str(site["shots"] / "export.png"), full_page=True)


# ----------------------------------------------------------------------------------------- issue 41
ATTACK = """<!doctype html><title>a page on another port</title>
<form id="f" method="POST" action="{target}/api/fetch" enctype="text/plain">
<input type="hidden" name='{{"preset": "tiny-flux.toml", "dry_run": true, "x": "' value='"}}'></form>
<script>
fetch("{target}/api/doctor", {{method: "POST", mode: "no-cors", credentials: "include",
  headers: {{"Content-Type": "text/plain"}}, body: JSON.stringify({{preset: "tiny-flux.toml"}})}})
  .finally(() => document.getElementById("f").submit());
</script>"""


def test_a_form_on_another_port_of_127_0_0_1_cannot_act(site, tmp_path) -> None:
    """Finding 1 (CSRF), as found: a page served from another port of 127.0.0.1 (the same site, so the
    SameSite=Strict cookie goes along) auto-submits a text/plain form and a no-cors fetch to the UI of
    a logged-in browser. Both are refused (403) and no job starts."""
    page, root, app = site["page"], site["root"], site["app"]
    (tmp_path / "attack.html").write_text(ATTACK.format(target=site["url"]))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    attacker = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=attacker.serve_forever, daemon=True).start()
    jobs = dict(app.state.launcher.jobs)
    answers: list = []

    def seen(r) -> None:
        if r.url.startswith(site["url"] + "/api/") and r.request.method == "POST":
            answers.append(r)

    page.on("response", seen)
    try:
        page.goto(f"http://127.0.0.1:{attacker.server_address[1]}/attack.html")
        page.wait_for_url(site["url"] + "/api/fetch")  # the form went (and the browser shows the answer)
        _until(lambda: {a.url.rsplit("/", 1)[1] for a in answers} >= {"fetch", "doctor"}, 30)
        assert sorted((a.url.rsplit("/", 1)[1], a.status) for a in answers) == [("doctor", 403), ("fetch", 403)]
        shown = json.loads(page.inner_text("body"))["error"]  # the form's answer, as the browser shows it
        assert shown.startswith("a same-site request (Sec-Fetch-Site) is refused: the UI takes actions only from its")
        assert app.state.launcher.jobs == jobs  # nothing started
        assert not (root / ".imglora-ui" / "fetch.log").exists() and not (root / ".imglora-ui" / "doctor.log").exists()
    finally:
        page.remove_listener("response", seen)
        attacker.shutdown()
        attacker.server_close()


def test_a_foreign_host_name_resolving_to_127_0_0_1_is_refused(site) -> None:
    """Finding 2 (DNS rebinding), as found: the browser opens the UI under a name that resolves to
    127.0.0.1 (as a rebinding attacker's does), with a token and with --no-token; the page, the API
    and the files answer 403, naming the Host and --allow-host, and show nothing of the root."""
    page = site["page"]
    server, thread, open_port = _serve(create_app(site["root"], None, PRESETS))  # as --no-token
    try:
        for port in (open_port, site["port"]):
            for path in ("/", "/api/runs", "/files/datasets/toy/01_sky.txt"):
                r = page.goto(f"http://{EVIL}:{port}{path}")
                assert r.status == 403, (port, path, r.status)
                error = r.json()["error"]
                assert error.startswith(f"Host '{EVIL}:{port}' is not a name this server answers to") and \
                    f"--allow-host {EVIL}" in error
                assert "sks" not in page.content() and "runs" not in r.json()
        assert page.goto(f"http://127.0.0.1:{open_port}/api/runs").status == 200  # its own address: answered
    finally:
        server.should_exit = True
        thread.join(10)
    page.goto(site["url"] + "/#runs")
    page.wait_for_selector("#runs-table")


def _mark(field: str) -> str:
    """Markup planted in a field: an element the page would grow if the value went in unescaped."""
    return f"<i data-xss={field}>{field}"


def _planted_root(tmp_path: Path) -> tuple[Path, Path]:
    """A root whose run, evaluation, log, dataset and preset carry markup in every field the page shows."""
    from PIL import Image

    root = tmp_path / "xss"
    run = root / "runs" / _mark("run")
    for sub in ("records", "eval", "export", "adapter"):
        (run / sub).mkdir(parents=True)
    (run / "log.jsonl").write_text('{"step": 1, "loss": 0.5}\n{"step": 2, "loss": 0.4}\n')
    (run / "records" / "20250101-000000-train.json").write_text(json.dumps(
        {"command": "train", "status": "error", "stage": _mark("stage")}))
    (run / "records" / "20250102-000000-eval.json").write_text(json.dumps(
        {"command": "eval", "started": _mark("started"), "status": _mark("evalstatus"), "best_step": _mark("best_step"),
         "losses": [{"step": _mark("recordstep")}]}))
    (run / "eval" / "losses.json").write_text(json.dumps(
        {"best_step": _mark("tablebest"), "base": None, "checkpoints": [{"step": _mark("ckptstep"), "heldout": 0.1,
                                                                         "train": 0.2}]}))
    Image.new("RGB", (8, 8)).save(run / "eval" / f"{_mark('sheet')}.png")
    (run / "export" / f"{_mark('export')}.json").write_text("{}")
    (run / "adapter" / "pytorch_lora_weights.safetensors").write_bytes(b"0")
    (run / "ui-train.log").write_text(f"loading\n{_mark('log')}\n")
    data = root / "datasets" / "x"
    data.mkdir(parents=True)
    Image.new("RGB", (512, 512), (90, 90, 200)).save(data / f"{_mark('image')}.png")
    (data / f"{_mark('image')}.txt").write_text(_mark("caption"))
    presets = root / "presets"
    presets.mkdir()
    for name in ("flux.toml", "tiny-flux.toml"):
        shutil.copy(PRESETS / name, presets / name)
    (presets / f"{_mark('preset')}.toml").write_text('extends = "tiny-flux.toml"\n')
    return root, presets


def test_markup_planted_in_every_field_shows_as_text(site, tmp_path, monkeypatch) -> None:
    """Finding 5 (stored XSS), as found and beyond: markup in run names, log lines, a failed record's
    stage, an evaluation record's steps and best_step, eval/losses.json's steps, file names, captions,
    preset names, keys' help and default, and error messages is shown as text: the page never grows an
    element from it."""
    from imglora.config import keys

    root, presets = _planted_root(tmp_path)
    real = keys.field_specs

    def planted(*a, **k):
        specs = real(*a, **k)
        specs[0] = specs[0] | {"help": _mark("help"), "default": _mark("default")}
        return specs

    monkeypatch.setattr(keys, "field_specs", planted)
    server, thread, port = _serve(create_app(root, TOKEN, presets))
    context = site["browser"].new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    planted_elements = "document.querySelectorAll('[data-xss]').length"
    try:
        page.goto(ui_url("127.0.0.1", port, TOKEN))
        page.wait_for_selector("tr.run")
        page.click("tr.run")
        _js_until(page, "document.querySelector('#run-name').textContent.includes('data-xss=run')")
        page.wait_for_selector("#ckpt-losses tr[data-step]")
        _js_until(page, "document.querySelector('#tail').textContent.includes('data-xss=log')")
        assert page.evaluate(planted_elements) == 0
        text = page.inner_text("#page-runs")
        for field in ("run", "stage", "started", "evalstatus", "best_step", "recordstep", "ckptstep", "sheet",
                      "export", "log"):
            assert _mark(field) in text, field
        assert page.get_attribute("#ckpt-losses tr[data-step]", "data-step") == _mark("ckptstep")
        page.goto(f"http://127.0.0.1:{port}/#new")
        page.wait_for_selector('#keys[data-preset] [data-key]')
        page.select_option("#preset", "tiny-flux.toml")
        page.wait_for_selector('#keys[data-preset="tiny-flux.toml"] [data-key]')
        page.fill("#offers", _mark("offer"))
        page.click("#btn-estimate")
        page.wait_for_selector("#estimate td.error")
        text = page.inner_text("#page-new")
        for field in ("help", "default", "offer"):
            assert _mark(field) in text, field
        assert _mark("preset") + ".toml" in page.eval_on_selector_all("#preset option", "os => os.map(o => o.text)")
        assert page.evaluate(planted_elements) == 0
        page.goto(f"http://127.0.0.1:{port}/#dataset")
        page.fill("#dataset-dir", "datasets/x")
        page.click("#btn-dataset")
        box = page.wait_for_selector("#gallery textarea")
        assert box.input_value() == _mark("caption") and box.get_attribute("data-image") == f"datasets/x/{_mark('image')}.png"
        assert f"datasets/x/{_mark('image')}.png" in page.inner_text("#gallery")
        page.fill("#dataset-dir", _mark("missing"))  # an error that quotes what was typed
        page.click("#btn-dataset")
        _js_until(page, "document.querySelector('#dataset-warnings').textContent.includes('does not exist')")
        assert _mark("missing") in page.inner_text("#dataset-warnings")
        assert page.evaluate(planted_elements) == 0
        page.screenshot(path=str(site["shots"] / "planted-markup.png"), full_page=True)
    finally:
        context.close()
        server.should_exit = True
        thread.join(10)
