"""``imglora ui``'s server: every endpoint, on real run folders written by a tiny training run, and
its refusals (token, paths outside the root, symlinks out of it, actions that do not apply), and the
guards of issue 41 (CSRF, DNS rebinding, Stop of a stranger's pid, served files, symlinks, outputs
outside the root, bad requests). Clients open the URL ``imglora ui`` prints, as a user does, and
send the XSRF cookie back in its header, as the page does."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from comfy_tree import fake_comfyui  # noqa: E402

from imglora.training import runlock  # noqa: E402
from imglora.errors import ImgloraError  # noqa: E402
from imglora.ui import run_folders as rv  # noqa: E402
from imglora.ui.server import create_app, serve, ui_url  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "presets"
TOKEN = "test-token-41"
PORT = 7860
BASE = f"http://127.0.0.1:{PORT}"


def _client(root: Path, token: str | None = TOKEN, presets: Path | None = PRESETS, **kw) -> TestClient:
    """A browser's view of the UI: the URL ``imglora ui`` prints opened (token swapped for a cookie),
    the page's XSRF cookie echoed in the X-XSRF-Token header of every request."""
    c = TestClient(create_app(root, token, presets, **kw), base_url=BASE)
    r = c.get(ui_url("127.0.0.1", PORT, token))
    assert r.status_code == 200 and str(r.url) == f"{BASE}/", r.text  # the clean URL, the token gone
    c.headers["X-XSRF-Token"] = c.cookies[f"imglora_xsrf_{PORT}"]
    return c


def _root(tmp: Path) -> Path:
    root = tmp / "root"
    (root / "datasets" / "toy").mkdir(parents=True)
    for f in sorted((REPO / "sample_datasets" / "sks_toy").glob("0[124]_*.*")):
        shutil.copy(f, root / "datasets" / "toy" / f.name)
    return root


def _overrides(root: Path, name: str, steps: int = 4, every: int = 2) -> list[str]:
    return [f'data.dir="{root / "datasets" / "toy"}"', f'cache.dir="{root / ".imglora" / "cache"}"',
            f'run.output_dir="{root / "runs"}"', f'run.name="{name}"', f"train.max_steps={steps}",
            f"train.checkpoint_every={every}", "train.log_every=1", "train.warmup_steps=0", "cache.text_max_length=16"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A root with one finished tiny run (4 updates, checkpoints at 2 and 4), trained in-process."""
    from imglora.commands.common import load_config
    from imglora.commands.train import train

    root = _root(tmp_path_factory.mktemp("ui"))
    cwd = os.getcwd()
    os.chdir(root)
    try:
        train(load_config(PRESETS / "tiny-flux.toml", _overrides(root, "done")), out=lambda s: None)
    finally:
        os.chdir(cwd)
    return root


@pytest.fixture()
def client(trained) -> TestClient:
    return _client(trained)


def test_runs_list_and_detail_read_the_run_folder(client, trained) -> None:
    data = client.get("/api/runs").json()
    assert data["root"] == str(trained.resolve())
    (run,) = data["runs"]
    assert run["name"] == "done" and run["state"] == "finished" and run["path"] == "runs/done"
    assert run["step"] == 4 and run["total"] == 4 and run["family"] == "flux" and run["loss"] > 0
    assert run["sec_per_update"] > 0 and run["eta_seconds"] is None  # not running
    d = client.get("/api/runs/done").json()
    assert [r["step"] for r in d["rows"]] == [1, 2, 3, 4] and len(d["smoothed"]) == 4
    assert d["smoothed"][0] == d["rows"][0]["loss"] and d["checkpoints"] == [2, 4]
    assert d["adapter"] == "runs/done/adapter/pytorch_lora_weights.safetensors"
    assert client.get(f"/files/{d['adapter']}").status_code == 200  # the page's download link
    assert client.get("/api/runs/nope").status_code == 404


def test_events_stream_sends_the_rows_and_the_state(client) -> None:
    with client.stream("GET", "/api/runs/done/events?after=2&once=1") as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    msg = json.loads(text.removeprefix("data: ").strip())
    assert [row["step"] for row in msg["rows"]] == [3, 4] and msg["summary"]["state"] == "finished"
    assert msg["tail"] == []  # trained in-process here: no ui-train.log


def test_files_inside_the_root_only(client, trained, tmp_path) -> None:
    adapter = next((trained / "runs" / "done" / "adapter").glob("*.safetensors"))
    rel = adapter.relative_to(trained)
    r = client.get(f"/files/{rel}")
    assert r.status_code == 200 and r.content == adapter.read_bytes()
    assert "attachment" in r.headers.get("content-disposition", "")  # a download
    secret = tmp_path / "secret.txt"
    secret.write_text("outside")
    (trained / "link-out").symlink_to(secret)
    for path, why in (("link-out", "leads outside the UI's root"), ("runs/%2E%2E/%2E%2E/secret.txt", "'..' is not allowed"),
                      ("%2Fetc%2Fpasswd", "an absolute path")):
        r = client.get(f"/files/{path}")
        assert r.status_code == 403 and why in r.json()["error"], (path, r.text)
    assert client.get("/files/runs/done/none.bin").status_code == 404
    (trained / "link-out").unlink()


def test_a_token_is_required_of_every_request_when_set(trained) -> None:
    c = TestClient(create_app(trained, "s3cret-token", PRESETS), base_url=BASE)
    assert c.get("/api/runs").status_code == 401 and c.get("/").status_code == 401
    assert "open the URL `imglora ui` printed" in c.get("/api/runs").json()["error"]
    assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret-token"}).status_code == 200
    assert c.get("/?token=wrong").status_code == 401
    r = c.get("/?token=s3cret-token", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/"  # to the clean URL: the token leaves history
    cookies = r.headers.get_list("set-cookie")
    assert any(x.startswith(f"imglora_token_{PORT}=s3cret-token;") and "HttpOnly" in x and "SameSite=strict" in x
               for x in cookies), cookies
    assert any(x.startswith(f"imglora_xsrf_{PORT}=") and "HttpOnly" not in x for x in cookies)  # the page reads it
    assert c.get("/api/runs").status_code == 200  # the cookie now
    r = c.get("/api/runs/done?token=s3cret-token&after=1", follow_redirects=False)  # other parameters kept
    assert r.status_code == 303 and r.headers["location"] == "/api/runs/done?after=1"
    with pytest.raises(ImgloraError, match="--host 0.0.0.0: the UI would be reachable from other machines; "
                                           "--no-token is only for 127.0.0.1"):
        serve(str(trained), host="0.0.0.0", no_token=True)


def test_page_and_static_files(client) -> None:
    page = client.get("/")
    assert page.status_code == 200 and '<script src="/static/app.js">' in page.text
    assert "EventSource" in client.get("/static/app.js").text
    assert client.get("/static/..%2F..%2Fcli.py").status_code in (403, 404)


def test_schema_check_and_presets(client) -> None:
    keys = {k["key"]: k for k in client.get("/api/schema").json()["keys"]}
    assert keys["lora.rank"]["default"] == "16" and keys["lora.rank"]["help"]
    assert "tiny-flux.toml" in client.get("/api/presets").json()["presets"]
    bad = client.post("/api/check", json={"preset": "tiny-flux.toml", "overrides": ["lora.rnak=4", "train.max_steps=-1"]})
    problems = bad.json()["problems"]
    assert bad.json()["ok"] is False and "lora.rnak" in problems and "did you mean" in problems.lower()
    assert "train.max_steps" in problems  # every problem at once
    good = client.post("/api/check", json={"preset": "tiny-flux.toml", "overrides": ["lora.rank=4"]}).json()
    assert good["ok"] and "rank = 4" in good["toml"]
    assert client.post("/api/check", json={"preset": "../pyproject.toml"}).status_code == 403
    assert client.post("/api/check", json={"preset": "nope.toml"}).status_code == 404


def test_schema_gives_each_key_its_widget_and_the_presets_value(client) -> None:
    """The form is made from the typed config: a key's type, choices and range, and the preset's value."""
    keys = {k["key"]: k for k in client.get("/api/schema", params={"preset": "tiny-flux.toml"}).json()["keys"]}
    assert keys["lora.rank"] | {"help": ""} == {"key": "lora.rank", "default": "16", "help": "", "type": "int",
                                                "choices": [], "min": 1, "max": 1024, "value": "8"}
    assert keys["lora.type"]["type"] == "choice" and keys["lora.type"]["choices"] == ["lora", "dora", "loha", "lokr", "oft"]
    assert keys["memory.gradient_checkpointing"]["type"] == "bool"
    assert keys["train.learning_rate"]["type"] == "float" and keys["train.learning_rate"]["min"] == 0.0
    assert keys["model.path"] == keys["model.path"] | {"type": "str", "value": '"tiny:flux"'}
    assert keys["lora.targets"]["type"] == keys["train.optimizer_args"]["type"] == "toml"
    assert keys["flux.timestep_sampling"]["value"] == '"shift"'  # the preset's family section
    assert "value" not in keys["sdxl.prediction_type"]  # another family's: no value for this preset
    assert "value" not in client.get("/api/schema").json()["keys"][0]  # no preset: defaults only
    assert client.get("/api/schema", params={"preset": "../pyproject.toml"}).status_code == 403
    # what the page sends for a string and a choice (JSON-quoted, which TOML reads back) is accepted
    ok = client.post("/api/check", json={"preset": "tiny-flux.toml",
                                         "overrides": ['data.trigger_word="a \\"quoted\\" word"', 'lora.type="dora"']}).json()
    assert ok["ok"], ok["problems"]
    assert 'trigger_word = "a \\"quoted\\" word"' in ok["toml"] and 'type = "dora"' in ok["toml"]


def test_plan_for_a_card(client) -> None:
    r = client.post("/api/plan", json={"preset": "tiny-flux.toml", "overrides": [], "gpu": "4090"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "peak allocated" in body["text"] and body["plan"]["settings"]


def test_schema_of_a_preset_with_problems_says_them(trained, tmp_path) -> None:
    presets = tmp_path / "presets"
    presets.mkdir()
    (presets / "bad.toml").write_text('extends = "%s"\n[lora]\nrnak = 4\n' % (PRESETS / "tiny-flux.toml").as_posix())
    c = _client(trained, presets=presets)
    r = c.get("/api/schema", params={"preset": "bad.toml"})
    assert r.status_code == 422 and "lora.rnak" in r.json()["error"] and "did you mean" in r.json()["error"].lower()
    assert c.get("/api/schema").status_code == 200  # the form without the preset's values, as the page falls back


def test_cost_per_offer_from_the_plan_of_the_card_it_names(client) -> None:
    from imglora.ui import costs

    offers = ["runpod H100 PCIe:2.49", "vast-rtx4090:0.40:1.5", "somewhere:1.00"]
    r = client.post("/api/estimate", json={"preset": "tiny-flux.toml", "overrides": ["train.checkpoint_every=2"],
                                           "gpu": "a100", "offers": offers + [""], "idle_minutes": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["steps"] == 100 and body["currency"] == "USD" and "not measured before a first run" in body["note"]
    h100, rtx, other = body["offers"]
    assert [h100["card"], rtx["card"], other["card"]] == ["h100-pcie", "4090", "a100"]  # else the card chosen
    plan = client.post("/api/plan", json={"preset": "tiny-flux.toml", "overrides": ["train.checkpoint_every=2"],
                                          "gpu": "h100-pcie"}).json()["plan"]
    own = plan["settings"][0]
    assert h100["setting"] == own["setting"] and h100["seconds_per_update"] == own["predicted_seconds_per_update"]
    assert "predicted for the H100 PCIe" in h100["basis"] and "not measured" in h100["basis"]
    assert h100["hours"] == pytest.approx((100 * h100["seconds_per_update"] + 360) / 3600, rel=1e-12)
    assert h100["cost"] == pytest.approx(h100["hours"] * 2.49, rel=1e-12)
    assert rtx["seconds_per_update"] == 1.5 and "measured there" in rtx["basis"]
    assert rtx["cost"] == pytest.approx((150 + 360) / 3600 * 0.40, rel=1e-12)
    assert costs.card_of("Lambda 1x H100 SXM", "h200") == "h100" and costs.card_of("l40s-spot", "h200") == "l40s"
    assert costs.card_of("box-13090", "h200") == "h200"  # not a 3090
    refused = [client.post("/api/estimate", json={"preset": "tiny-flux.toml", **b}).json()["error"] for b in
               ({"offers": []}, {"offers": ["h100:cheap"]}, {"offers": ["h100:1"], "overrides": ["train.max_steps=0",
                                                                                              "train.epochs=2"]})]
    assert "no offer" in refused[0] and "'h100:cheap': expected NAME:RATE" in refused[1]
    assert "train.max_steps is 0" in refused[2] and "enter the number of updates" in refused[2]
    r = client.post("/api/estimate", json={"preset": "tiny-flux.toml", "offers": ["h100:1"], "steps": 10,
                                           "overrides": ["train.max_steps=0", "train.epochs=2"]})
    assert r.status_code == 200 and r.json()["steps"] == 10


def test_a_setting_that_does_not_fit_the_card_is_replaced_by_the_fastest_that_fits() -> None:
    from types import SimpleNamespace

    from imglora.ui import costs

    def setting(name: str, fits: bool, seconds: float) -> SimpleNamespace:
        return SimpleNamespace(setting=SimpleNamespace(name=name), fits=lambda vram, host, kind: fits,
                               measured_seconds=None, predicted=SimpleNamespace(seconds=seconds), time_note=None)

    plan = SimpleNamespace(settings=[setting("model:0", False, 1.0), setting("fp8:18", True, 2.0)],
                           fastest_fit="fp8:18")
    (row,) = costs.offer_rows(["vast-3090:0.2"], "h200", 100, 0, 0.0, "EUR", lambda card: plan)
    assert row.card == "3090" and row.setting == "fp8:18" and row.seconds_per_update == 2.0
    assert "the preset's model:0 does not fit its 24 GiB; fp8:18, the fastest that fits" in row.basis
    assert row.cost == pytest.approx(200 / 3600 * 0.2, rel=1e-12)
    plan.fastest_fit = None
    (row,) = costs.offer_rows(["vast-3090:0.2"], "h200", 100, 0, 0.0, "EUR", lambda card: plan)
    assert row.setting is None and row.cost is None and "no setting fits" in row.basis


def test_dataset_captions_edited_in_place(client, trained) -> None:
    d = client.get("/api/dataset", params={"dir": "datasets/toy"}).json()
    assert [i["image"] for i in d["items"]] == ["datasets/toy/01_sky.png", "datasets/toy/02_grass.jpg",
                                               "datasets/toy/04_wall.png"]
    assert d["items"][0]["caption"] == (trained / "datasets/toy/01_sky.txt").read_text().strip()
    # the scan's warnings, and beside each image those that name it (02 and 04 are upscaled > 2x at 1024 px)
    assert any("enlarged" in w for w in d["warnings"])
    assert [bool(i["warnings"]) for i in d["items"]] == [False, True, True]
    r = client.put("/api/caption", json={"image": "datasets/toy/01_sky.png", "caption": "a  new\ncaption"})
    assert r.status_code == 200 and (trained / "datasets/toy/01_sky.txt").read_text() == "a new caption\n"
    assert client.get("/api/dataset", params={"dir": "datasets/toy"}).json()["items"][0]["caption"] == "a new caption"
    assert not list((trained / "datasets/toy").glob("*tmp*"))
    assert client.put("/api/caption", json={"image": "runs/done/log.jsonl", "caption": "x"}).status_code == 404
    assert client.put("/api/caption", json={"image": "/etc/hosts", "caption": "x"}).status_code == 403
    assert client.get("/api/dataset", params={"dir": "../"}).status_code == 403


def test_dataset_masks_and_sources_found_and_checked_as_training_does(client, trained) -> None:
    from PIL import Image

    masks, sources = trained / "datasets" / "toy_masks", trained / "datasets" / "toy_sources"
    masks.mkdir(exist_ok=True)
    sources.mkdir(exist_ok=True)
    half = Image.new("L", (512, 512), 0)
    half.paste(255, (0, 0, 256, 512))
    half.save(masks / "01_sky.png")
    Image.new("L", (64, 64), 255).save(masks / "02_grass.png")  # not its image's size: a problem
    Image.new("RGB", (512, 512), (9, 9, 9)).save(sources / "01_sky.png")
    Image.new("RGB", (512, 512), (9, 9, 9)).save(sources / "01_sky_1.png")
    try:
        d = client.get("/api/dataset", params={"dir": "datasets/toy", "mask_dir": "datasets/toy_masks",
                                               "control_dir": "datasets/toy_sources"}).json()
        sky, grass, wall = d["items"]
        assert sky["mask"] == "datasets/toy_masks/01_sky.png"
        assert sky["controls"] == ["datasets/toy_sources/01_sky.png", "datasets/toy_sources/01_sky_1.png"]
        assert grass["mask"] is None and wall["mask"] is None and grass["controls"] == wall["controls"] == []
        assert any("02_grass.png: the mask is 64x64 but its image 02_grass.jpg is" in p for p in d["problems"])
        assert any("02_grass.png: the mask is 64x64" in w for w in grass["warnings"])  # beside the image it names
        assert any("have no mask in" in w and "04_wall.png" in w for w in d["warnings"])
        assert any("no source image in control_dir" in p and "04_wall.png" in p for p in d["problems"])
        assert client.get(f"/files/{sky['mask']}").status_code == 200  # the overlay the page draws
        assert client.get("/api/dataset", params={"dir": "datasets/toy", "mask_dir": "/etc"}).status_code == 403
        assert client.get("/api/dataset", params={"dir": "datasets/toy", "mask_dir": "nope"}).status_code == 200
    finally:
        shutil.rmtree(masks)
        shutil.rmtree(sources)


def test_held_out_loss_per_checkpoint_with_the_best_marked(tmp_path) -> None:
    """After the evaluation pass: each checkpoint's held-out and training-image loss as eval/losses.json
    has them, the lowest held-out loss marked best, with its adapter, contact sheet and the plot."""
    from imglora.commands.common import load_config
    from imglora.commands.evaluate import evaluate
    from imglora.commands.train import train

    root = _root(tmp_path)
    train(load_config(PRESETS / "tiny-flux.toml", _overrides(root, "held") + ["eval.holdout=1"]), out=lambda s: None)
    c = _client(root)
    assert c.get("/api/runs/held").json()["eval_losses"] is None  # not evaluated yet
    evaluate(root / "runs" / "held", all_checkpoints=True, out=lambda s: None)
    d = c.get("/api/runs/held").json()
    table = json.loads((root / "runs/held/eval/losses.json").read_text())
    el = d["eval_losses"]
    assert [r["step"] for r in el["checkpoints"]] == [2, 4] and el["base"] == table["base"]
    assert [(r["heldout"], r["train"]) for r in el["checkpoints"]] == [(r["heldout"], r["train"]) for r in table["checkpoints"]]
    best = min(el["checkpoints"], key=lambda r: r["heldout"])
    assert el["best_step"] == best["step"] == table["best_step"] and d["evals"][-1]["best_step"] == best["step"]
    assert [r["best"] for r in el["checkpoints"]] == [r is best for r in el["checkpoints"]]
    for r in el["checkpoints"]:
        assert r["adapter"] == f"runs/held/checkpoints/step-{r['step']:06d}/adapter"
        assert r["sheet"] == f"runs/held/eval/step-{r['step']:06d}/contact_sheet.png"
        assert c.get(f"/files/{r['sheet']}").status_code == 200
    assert el["plot"] == "runs/held/eval/loss_vs_step.png" and d["evals"][-1]["steps"] == [2, 4]


def test_actions_that_do_not_apply_are_refused(client) -> None:
    r = client.post("/api/runs/done/stop")
    assert r.status_code == 409 and "done is not running" in r.json()["error"]
    r = client.post("/api/runs/done/resume")
    assert r.status_code == 409 and "done is finished: nothing to resume" in r.json()["error"]
    r = client.post("/api/runs", json={"preset": "tiny-flux.toml", "overrides": ["lora.rnak=4"]})
    assert r.status_code == 422 and "lora.rnak" in r.json()["error"]
    assert client.get("/api/jobs/nope").status_code == 404


def _wait(fn, timeout: float = 120.0, every: float = 0.5):
    t0 = time.time()
    while time.time() - t0 < timeout:
        got = fn()
        if got:
            return got
        time.sleep(every)
    raise AssertionError("timed out")


@pytest.mark.slow  # a process of its own; the browser test exports too
def test_export_job_writes_into_a_comfyui_folder(client, trained) -> None:
    comfy = fake_comfyui(trained / "ComfyUI", "loras")
    job = client.post("/api/runs/done/export", json={"comfyui": "ComfyUI"}).json()
    assert job["argv"][:2] == ["export", str(trained / "runs" / "done")]
    done = _wait(lambda: (j := client.get(f"/api/jobs/{job['id']}").json()) and not j["running"] and j)
    assert done["returncode"] == 0, done["tail"]
    assert list((comfy / "models" / "loras").glob("*.safetensors"))
    assert client.post("/api/runs/done/export", json={"comfyui": "/tmp"}).status_code == 403
    job = client.post("/api/runs/done/export", json={}).json()  # no folder: the run's export/, to download
    assert _wait(lambda: (j := client.get(f"/api/jobs/{job['id']}").json()) and not j["running"] and j)["returncode"] == 0
    exports = client.get("/api/runs/done").json()["exports"]
    assert exports == ["runs/done/export/done.safetensors", "runs/done/export/done.workflow-api.json",
                       "runs/done/export/done.workflow.json"]
    got = client.get(f"/files/{exports[0]}")
    assert got.status_code == 200 and got.content == (trained / exports[0]).read_bytes()
    assert 'filename="done.safetensors"' in got.headers["content-disposition"]


@pytest.mark.slow
def test_start_stop_and_resume_a_run_through_the_api(trained) -> None:
    """A run started from the form as `imglora train` in a process of its own: it trains (rows appear),
    Stop sends SIGTERM (a checkpoint, then interrupted and resumable), Resume continues it."""
    c = _client(trained)
    overrides = _overrides(trained, "live", steps=400, every=1000)
    r = c.post("/api/runs", json={"preset": "tiny-flux.toml", "overrides": overrides})
    assert r.status_code == 200, r.text
    assert json.loads((trained / "runs/live" / rv.UI_RUN).read_text())["overrides"] == overrides
    _wait(lambda: (s := c.get("/api/runs/live").json())["state"] == "running" and len(s["rows"]) >= 2, 180)
    assert c.post("/api/runs/live/stop").status_code == 200
    s = _wait(lambda: (s := c.get("/api/runs/live").json())["state"] == "interrupted" and s, 180)
    assert s["resumable"] and s["checkpoints"] and s["step"] < 400
    stopped_at = s["checkpoints"][-1]
    assert c.post("/api/runs/live/resume").status_code == 200
    _wait(lambda: (s := c.get("/api/runs/live").json())["state"] == "running" and s["step"] > stopped_at, 180)
    assert c.post("/api/runs/live/stop").status_code == 200
    final = _wait(lambda: (s := c.get("/api/runs/live").json())["state"] == "interrupted" and s, 180)
    steps = [r["step"] for r in final["rows"]]
    assert steps == sorted(set(steps)) and final["step"] > stopped_at  # resumed, no update logged twice
    assert (trained / "runs/live" / rv.UI_LOG).stat().st_size > 0  # both processes' output, for the page's tail


@pytest.mark.slow  # processes of their own
def test_doctor_fetch_and_eval_run_as_jobs(client, trained) -> None:
    def finished(job: dict) -> dict:
        return _wait(lambda: (j := client.get(f"/api/jobs/{job['id']}").json()) and not j["running"] and j)

    fetch = finished(client.post("/api/fetch", json={"preset": "tiny-flux.toml", "dry_run": True}).json())
    assert fetch["argv"][:1] == ["fetch"] and fetch["argv"][-1] == "--dry-run" and fetch["returncode"] == 0
    assert any("a tiny model imglora builds on this machine; nothing to fetch" in line for line in fetch["tail"])
    doctor = finished(client.post("/api/doctor", json={"preset": "tiny-flux.toml"}).json())
    assert doctor["argv"][0] == "doctor" and doctor["returncode"] in (0, 1) and doctor["tail"]
    assert any("CUDA" in line or "GPU" in line for line in doctor["tail"])
    assert client.post("/api/doctor", json={"preset": "../pyproject.toml"}).status_code == 403
    overrides = _overrides(trained, "cached") + [f'cache.dir="{trained / "fresh-cache"}"']  # nothing to reuse
    cache = finished(client.post("/api/cache", json={"preset": "tiny-flux.toml", "overrides": overrides}).json())
    assert cache["argv"][:2] == ["cache-latents", str(PRESETS / "tiny-flux.toml")] and cache["returncode"] == 0
    assert any("encoding latents: 3/3" in line for line in cache["tail"]), cache["tail"]  # its progress, shown
    assert any("latents: 3 encoded, 0 reused" in line for line in cache["tail"])
    assert client.post("/api/cache", json={"preset": "/etc/passwd"}).status_code == 403
    ev = finished(client.post("/api/runs/done/eval").json())
    assert ev["argv"][:2] == ["eval", str(trained / "runs" / "done")] and ev["returncode"] == 0, ev["tail"]
    d = client.get("/api/runs/done").json()
    assert any(p.endswith("contact_sheet.png") for p in d["sheets"]) and d["evals"]
    # no held-out images in this run: losses per checkpoint, none named best
    assert [(r["step"], r["heldout"], r["best"]) for r in d["eval_losses"]["checkpoints"]] == [(2, None, False),
                                                                                              (4, None, False)]


# ----------------------------------------------------------------------------------------- issue 41
# Each finding of the attack on `imglora ui` (issue 41) with the test that shows it is closed.

EVIL = "http://evil.example"
ACTIONS = [  # every state-changing endpoint, with a body that would otherwise start something
    ("POST", "/api/runs", {"preset": "tiny-flux.toml", "overrides": []}),
    ("POST", "/api/runs/done/stop", {}), ("POST", "/api/runs/done/resume", {}), ("POST", "/api/runs/done/eval", {}),
    ("POST", "/api/runs/done/export", {}), ("POST", "/api/doctor", {"preset": "tiny-flux.toml"}),
    ("POST", "/api/fetch", {"preset": "tiny-flux.toml", "dry_run": True}),
    ("POST", "/api/cache", {"preset": "tiny-flux.toml", "overrides": []}),
    ("PUT", "/api/caption", {"image": "datasets/toy/01_sky.png", "caption": "planted"}),
    ("POST", "/api/check", {"preset": "tiny-flux.toml"}),
]


@pytest.mark.parametrize("token", [TOKEN, None], ids=["token", "no-token"])
def test_cross_site_requests_are_refused_before_any_action(trained, token) -> None:
    """Finding 1 (CSRF): a foreign Origin, a cross-site or same-site (another port of 127.0.0.1)
    Sec-Fetch-Site, a form's Content-Type or a missing X-XSRF-Token: refused, nothing started or written."""
    c = _client(trained, token)
    caption = (trained / "datasets/toy/01_sky.txt").read_text()

    def job_logs() -> dict:  # what the UI's jobs have written (other tests' jobs may have run before)
        return {p.name: p.stat().st_size for p in (trained / ".imglora-ui").glob("*")}

    before = job_logs()
    plain = {"content-type": "text/plain"}
    for method, path, body in ACTIONS:
        data = json.dumps(body)
        r = c.request(method, path, content=data, headers={"Origin": EVIL, **plain})  # the text/plain form
        assert r.status_code == 403 and "Origin 'http://evil.example' is not this server" in r.json()["error"], path
        r = c.request(method, path, content=data, headers={"Origin": "http://127.0.0.1:8000",
                                                           "Sec-Fetch-Site": "same-site", **plain})
        assert r.status_code == 403 and "a same-site request (Sec-Fetch-Site) is refused" in r.json()["error"], path
        r = c.request(method, path, json=body, headers={"Origin": "http://127.0.0.1:8000"})  # the same cookies
        assert r.status_code == 403 and "cross-site requests are refused" in r.json()["error"]
        r = c.request(method, path, content=data, headers=plain)  # same origin, but not JSON
        assert r.status_code == 415 and "Content-Type 'text/plain'" in r.json()["error"], path
        r = c.request(method, path, json=body, headers={"X-XSRF-Token": ""})  # the page's header missing
        assert r.status_code == 403 and "missing or wrong x-xsrf-token header" in r.json()["error"], path
        r = c.request(method, path, json=body, headers={"X-XSRF-Token": "forged.value"})
        assert r.status_code == 403, path
    assert c.app.state.launcher.jobs == {} and job_logs() == before
    assert (trained / "datasets/toy/01_sky.txt").read_text() == caption
    # from the page itself (same Origin, JSON, the header): accepted
    r = c.post("/api/check", json={"preset": "tiny-flux.toml"}, headers={"Origin": BASE, "Sec-Fetch-Site": "same-origin"})
    assert r.status_code == 200 and r.json()["ok"]
    if token:  # a script with the token in its Authorization header needs no XSRF cookie
        bare = TestClient(c.app, base_url=BASE)
        r = bare.post("/api/check", json={"preset": "tiny-flux.toml"}, headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["ok"]


def test_a_foreign_host_is_refused_against_dns_rebinding(trained) -> None:
    """Finding 2 (DNS rebinding): a Host that is not a localhost name, the bound address or an
    --allow-host name gets 403 naming the Host and the flag, on every path."""
    c = _client(trained)
    for path in ("/", "/api/runs", "/files/runs/done/log.jsonl", "/static/app.js"):
        r = c.get(path, headers={"Host": f"evil.example:{PORT}"})
        assert r.status_code == 403, path
        assert r.json()["error"].startswith(f"Host 'evil.example:{PORT}' is not a name this server answers to")
        assert "--allow-host evil.example" in r.json()["error"] and "runs" not in r.json()
    for host in (f"localhost:{PORT}", f"127.0.0.1:{PORT}", f"[::1]:{PORT}"):
        assert c.get("/api/runs", headers={"Host": host}).status_code == 200, host
    tunnel = _client(trained, allow_hosts=("ui.tunnel.example",))
    assert tunnel.get("/api/runs", headers={"Host": f"ui.tunnel.example:{PORT}"}).status_code == 200
    assert tunnel.get("/api/runs", headers={"Host": f"evil.example:{PORT}"}).status_code == 403
    # bound to every address: the machine's IP addresses are names too (rebinding needs a DNS name)
    anywhere = _client(trained, host="0.0.0.0")
    assert anywhere.get("/api/runs", headers={"Host": f"10.1.2.3:{PORT}"}).status_code == 200
    assert anywhere.get("/api/runs", headers={"Host": f"evil.example:{PORT}"}).status_code == 403


def test_serve_makes_a_token_and_prints_the_url_that_swaps_it_for_a_cookie(trained, monkeypatch) -> None:
    """A token by default, localhost included, printed once in the URL to open; --no-token opts out
    with a warning; non-ASCII tokens in a header, cookie or ?token= are a 401, not a 500."""
    import uvicorn

    served: dict = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.update(app=app, **kw))
    lines: list[str] = []
    serve(str(trained), port=PORT, presets=str(PRESETS), out=lines.append)
    (line,) = lines
    url = line.split("open ", 1)[1].split(" ", 1)[0]
    assert url.startswith(f"http://127.0.0.1:{PORT}/?token=") and len(url.split("=", 1)[1]) >= 32
    assert served["host"] == "127.0.0.1" and served["port"] == PORT
    c = TestClient(served["app"], base_url=BASE)
    assert c.get("/api/runs").status_code == 401  # nothing without it
    r = c.get(url, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/" and r.headers["referrer-policy"] == "no-referrer"
    assert "done" in [r["name"] for r in c.get("/api/runs").json()["runs"]]
    lines.clear()
    serve(str(trained), port=PORT, presets=str(PRESETS), no_token=True, out=lines.append)
    assert lines[0].startswith("warning: --no-token: any program or user on this machine can reach the UI")
    assert lines[1].startswith(f"imglora ui: open http://127.0.0.1:{PORT}/ (root")
    assert TestClient(served["app"], base_url=BASE).get("/api/runs").status_code == 200
    with pytest.raises(ImgloraError, match="--token 'é-not-ascii': a token is at least 8 characters of"):
        serve(str(trained), token="é-not-ascii")
    with pytest.raises(ImgloraError, match="--no-token and --token contradict each other"):
        serve(str(trained), token="abcdefgh12", no_token=True)
    bare = TestClient(create_app(trained, TOKEN, PRESETS), base_url=BASE)
    for headers in ({"Authorization": "Bearer é".encode()}, {"Authorization": "Bearer \xe9".encode("latin-1")},
                    {"Cookie": f"imglora_token_{PORT}=é".encode()}):
        r = bare.get("/api/runs", headers=headers)
        assert r.status_code == 401 and "a token is needed" in r.json()["error"], headers
    r = bare.get("/?token=%C3%A9%00")
    assert r.status_code == 401 and "wrong token in ?token=" in r.json()["error"]


def _fake_train(tmp_path: Path, run: Path) -> subprocess.Popen:
    """A process whose command line is `imglora train ...` (a script named imglora) holding ``run``'s lock."""
    script = tmp_path / "bin" / "imglora"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import sys, time\nfrom imglora.training import runlock\n"
                      "with runlock.hold(sys.argv[3], 'imglora train ' + sys.argv[2]):\n"
                      "    print('held', flush=True)\n    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, str(script), "train", "x.toml", str(run)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_stop_signals_only_the_imglora_run_the_lock_describes(trained, tmp_path) -> None:
    """Finding 3: a lock written on another host, a stale one, or one whose pid is now another process
    is not a live run: Stop answers 409 with the reason and signals nothing. The run's own process is
    stopped."""
    run = trained / "runs" / "locked"
    run.mkdir()
    (run / "log.jsonl").write_text("")
    lock = run / runlock.LOCK_NAME
    c = _client(trained)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    started = psutil.Process(bystander.pid).create_time()
    try:
        cases = [({"host": "other-box"}, "the lock was written on host 'other-box', not on this one"),
                 ({"pid": dead.pid}, f"pid {dead.pid} is not running (a stale lock"),
                 ({"create_time": started - 50}, "another process has that pid now"),  # the pid reused
                 ({"time": started - 50}, "after the lock was written"),  # an old lock (no create_time)
                 ({"create_time": started}, "not the lock's 'imglora train x.toml'")]  # not imglora at all
        for change, why in cases:
            info = {"pid": bystander.pid, "host": here, "time": time.time(), "command": "imglora train x.toml"} | change
            if "time" in change:
                info.pop("create_time", None)
            lock.write_text(json.dumps(info))
            r = c.post("/api/runs/locked/stop")
            assert r.status_code == 409 and why in r.json()["error"], (change, r.text)
            assert r.json()["error"].startswith("locked: not stopping pid")
            assert bystander.poll() is None  # not signalled
        lock.write_text(json.dumps({"pid": bystander.pid, "host": "other-box", "time": time.time(),
                                    "command": "imglora train x.toml"}))
        listed = {r["name"]: r for r in c.get("/api/runs").json()["runs"]}["locked"]
        assert listed["state"] == "running" and listed["detail"] == f"pid {bystander.pid} on other-box"
        lock.write_text(json.dumps({"pid": bystander.pid, "host": here, "time": time.time(), "command": "imglora train"}))
        assert {r["name"]: r for r in c.get("/api/runs").json()["runs"]}["locked"]["state"] != "running"
        lock.unlink()
        holder = _fake_train(tmp_path, run)  # the run itself: stopped
        assert c.get("/api/runs/locked").json()["state"] == "running"
        r = c.post("/api/runs/locked/stop")
        assert r.status_code == 200 and r.json() == {"stopping": "locked", "pid": holder.pid}
        assert holder.wait(30) == -signal.SIGTERM
    finally:
        bystander.kill()
        bystander.wait()
        shutil.rmtree(run)


def test_served_files_are_sandboxed_and_the_page_sends_a_csp(client, trained) -> None:
    """Finding 4: an .html or .svg under the root is a sandboxed download, never a page of the UI's
    origin; every file carries CSP sandbox and nosniff; the page sends a CSP without inline script,
    X-Frame-Options and Referrer-Policy."""
    (trained / "evil.html").write_text("<script>fetch('/api/runs')</script>")
    (trained / "evil.svg").write_text('<svg xmlns="http://www.w3.org/2000/svg"><script>alert(1)</script></svg>')
    try:
        for name in ("evil.html", "evil.svg"):
            r = client.get(f"/files/{name}")
            assert r.status_code == 200 and r.headers["content-security-policy"].startswith("sandbox;")
            assert r.headers["content-disposition"] == f'attachment; filename="{name}"'
            assert r.headers["content-type"] == "application/octet-stream"
            assert r.headers["x-content-type-options"] == "nosniff"
        sheet = client.get("/files/datasets/toy/01_sky.png")  # an image the page shows: inline, sandboxed
        assert sheet.headers["content-type"] == "image/png" and "content-disposition" not in sheet.headers
        assert sheet.headers["content-security-policy"].startswith("sandbox;")
        page = client.get("/")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self';" in csp and "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert page.headers["x-frame-options"] == "DENY" and page.headers["referrer-policy"] == "no-referrer"
        assert page.headers["x-content-type-options"] == "nosniff"
        scripts = re.findall(r"<script\b[^>]*>(.*?)</script>", page.text, re.S)
        assert scripts == [""]  # one script, from a file: none inline
        assert re.search(r"<[^>]*\son[a-z]+\s*=", page.text, re.I) is None  # no on* handler attribute
    finally:
        (trained / "evil.html").unlink()
        (trained / "evil.svg").unlink()


def test_links_out_of_the_root_are_not_read_in_a_dataset(client, trained, tmp_path) -> None:
    """Finding 6: a caption, image or mask whose real path leaves the root is not read (as nothing is
    written through one): 403 naming it; writing the caption replaces the link."""
    from PIL import Image

    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0 the secret")
    Image.new("RGB", (64, 64)).save(tmp_path / "outside.png")
    ds, masks = trained / "datasets" / "linked", trained / "datasets" / "linked_masks"
    ds.mkdir()
    masks.mkdir()
    params = {"dir": "datasets/linked", "mask_dir": "datasets/linked_masks"}
    try:
        Image.new("RGB", (512, 512), (200, 10, 10)).save(ds / "a.png")
        (ds / "a.txt").symlink_to(secret)
        r = client.get("/api/dataset", params=params)
        assert r.status_code == 403 and "the secret" not in r.text
        assert r.json()["error"] == ("dir: datasets/linked/a.txt leads outside the UI's root (a symlink); the UI reads "
                                     "nothing there: copy the file into the root instead of linking it")
        r = client.put("/api/caption", json={"image": "datasets/linked/a.png", "caption": "mine"})
        assert r.status_code == 200 and secret.read_text() == "root:x:0:0 the secret"  # the link is replaced
        assert not (ds / "a.txt").is_symlink() and (ds / "a.txt").read_text() == "mine\n"
        (ds / "b.png").symlink_to(tmp_path / "outside.png")
        r = client.get("/api/dataset", params=params)
        assert r.status_code == 403 and r.json()["error"].startswith("dir: datasets/linked/b.png leads outside")
        (ds / "b.png").unlink()
        (masks / "a.png").symlink_to(tmp_path / "outside.png")
        r = client.get("/api/dataset", params=params)
        assert r.status_code == 403 and r.json()["error"].startswith("mask_dir: datasets/linked_masks/a.png leads")
        (masks / "a.png").unlink()
        (masks / "a.png").symlink_to(ds / "a.png")  # a link that stays inside the root: read
        d = client.get("/api/dataset", params=params).json()
        assert [(i["image"], i["caption"], i["mask"]) for i in d["items"]] == [
            ("datasets/linked/a.png", "mine", "datasets/linked/a.png")]
    finally:
        shutil.rmtree(ds)
        shutil.rmtree(masks)


def test_outputs_outside_the_root_are_refused_naming_the_key(client, trained, tmp_path) -> None:
    """Finding 7: run.output_dir, cache.dir and export.comfyui_dir set from the form must resolve
    inside the root (422 naming the key, nothing written); Check says so too."""
    elsewhere = tmp_path / "elsewhere"
    base = _overrides(trained, "outside")
    for key, value in (("run.output_dir", str(elsewhere)), ("run.output_dir", "../escape"),
                       ("cache.dir", str(elsewhere / "cache")), ("export.comfyui_dir", "/tmp")):
        overrides = [o for o in base if not o.startswith(key + "=")] + [f'{key}="{value}"']
        for path in ("/api/runs", "/api/cache"):
            r = client.post(path, json={"preset": "tiny-flux.toml", "overrides": overrides})
            assert r.status_code == 422, (key, path, r.text)
            assert r.json()["error"].startswith(f"{key} = {value!r} is ") and "outside the UI's root" in r.json()["error"]
        check = client.post("/api/check", json={"preset": "tiny-flux.toml", "overrides": overrides}).json()
        assert check["ok"] is False and check["problems"].startswith(f"{key} = ")
    assert not elsewhere.exists() and not (trained / "runs" / "outside").exists()
    assert not (trained.parent / "escape").exists() and client.app.state.launcher.jobs == {}


def test_bad_requests_get_a_4xx_with_a_message(client, trained) -> None:
    """Finding 8: NUL bytes, over-long names, bad JSON, wrong types, a form's line break, bodies over
    the limits: each a 4xx naming what is wrong, never a 500."""
    long = "a" * 5000
    for path, status, why in [("/files/a%00b", 400, "a NUL byte in the path"),
                              (f"/files/{'n' * 300}.png", 400, "a name of 304 bytes in the path"),
                              (f"/files/{long}", 400, "a path of 5000 characters"),
                              (f"/api/runs/{long}", 404, "no run folder named"),
                              ("/api/dataset?dir=data%00sets", 400, "a NUL byte"),
                              (f"/api/schema?preset={'p' * 300}.toml", 400, "a name of 305 bytes")]:
        r = client.get(path)
        assert r.status_code == status and why in r.json()["error"], (path, r.text)
    js = {"content-type": "application/json"}
    for body, status, why in [(b'{"preset": "tiny-flux.toml", "over', 400, "the body is not valid JSON"),
                              (b"\xff\xfe", 400, "the body is not valid JSON"),
                              (b"[1, 2]", 422, "the body is JSON list; send one JSON object"),
                              (b'{"preset": 7}', 422, "preset: expected a string, got 7"),
                              (b'{"preset": "tiny-flux.toml", "overrides": "lora.rank=4"}', 422,
                               "overrides: expected a list of KEY=VALUE strings"),
                              (b'{"preset": "tiny-flux.toml", "overrides": [4]}', 422, "overrides: expected a list"),
                              (b'{"preset": "a\\u0000.toml"}', 400, "a NUL byte in the path")]:
        for path in ("/api/check", "/api/runs", "/api/plan", "/api/estimate", "/api/cache"):
            r = client.post(path, content=body, headers=js)
            assert r.status_code == status and why in r.json()["error"], (path, body, r.text)
    r = client.post("/api/estimate", json={"preset": "tiny-flux.toml", "offers": ["h100:1"], "idle_minutes": [1]})
    assert r.status_code == 422 and "idle_minutes: expected an integer or a number, got [1]" in r.json()["error"]
    r = client.post("/api/fetch", json={"preset": "tiny-flux.toml", "dry_run": "yes"})
    assert r.status_code == 422 and "dry_run: expected true or false" in r.json()["error"]
    # a line break in a form value would end it early and drop what follows: refused, naming the key
    r = client.post("/api/runs", json={"preset": "tiny-flux.toml",
                                       "overrides": ['data.trigger_word="sks\nlora.rank=1"']})
    assert r.status_code == 422 and r.json()["error"].startswith("data.trigger_word: a line break in its value")
    r = client.post("/api/check", json={"preset": "tiny-flux.toml", "overrides": ["lora.rank=4\r"]})
    assert r.status_code == 422 and r.json()["error"].startswith("lora.rank: a line break")
    # bodies: 1 MB in all, a caption 64 KB
    r = client.post("/api/check", content=b'{"x": "' + b"a" * (1 << 20) + b'"}', headers=js)
    assert r.status_code == 413 and "at most 1048576" in r.json()["error"]
    r = client.put("/api/caption", json={"image": "datasets/toy/01_sky.png", "caption": "word " * 14000})
    assert r.status_code == 413 and "bytes" in r.json()["error"]
    r = client.put("/api/caption", json={"image": "datasets/toy/01_sky.png", "caption": "a\x00b"})
    assert r.status_code == 422 and "caption: a NUL byte" in r.json()["error"]
    assert client.app.state.launcher.jobs == {}


def test_a_malformed_record_shows_that_run_unreadable_and_the_rest_as_usual(client, trained) -> None:
    """Finding 8: one truncated records/*.json no longer fails /api/runs for every run."""
    bad = trained / "runs" / "broken"
    shutil.copytree(trained / "runs" / "done", bad)
    try:
        record = sorted((bad / "records").glob("*.json"))[0]
        record.write_text(record.read_text()[:40])
        with (bad / "log.jsonl").open("a") as fh:
            fh.write('{"step": "<b>7</b>", "loss": "x"}\n[1, 2]\n')  # rows of the wrong shape: skipped
        r = client.get("/api/runs")
        assert r.status_code == 200
        runs = {x["name"]: x for x in r.json()["runs"]}
        assert runs["done"]["state"] == "finished" and runs["done"]["step"] == 4
        assert runs["broken"]["state"] == "unreadable"
        assert runs["broken"]["detail"].startswith(f"unreadable record: records/{record.name}: ")
        d = client.get("/api/runs/broken")
        assert d.status_code == 200 and d.json()["state"] == "unreadable" and "unreadable record" in d.json()["error"]
        with client.stream("GET", "/api/runs/broken/events?once=1") as s:
            assert json.loads("".join(s.iter_text()).removeprefix("data: "))["summary"]["state"] == "unreadable"
    finally:
        shutil.rmtree(bad)


def test_a_second_start_of_one_name_at_once_is_refused_before_anything_is_written(trained) -> None:
    """Finding 8: two starts of one run at the same moment: one starts, the other gets 409, and the
    run's ui-run.json holds the winner's overrides."""
    import asyncio

    import httpx

    c = _client(trained)
    bodies = [{"preset": "tiny-flux.toml", "overrides": _overrides(trained, "twice", steps=400) + [f"lora.rank={r}"]}
              for r in (4, 8)]

    async def both() -> list:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=c.app), base_url=BASE,
                                     cookies=dict(c.cookies), headers=dict(c.headers)) as ac:
            return await asyncio.gather(*(ac.post("/api/runs", json=b) for b in bodies))

    answers = asyncio.run(both())
    try:
        codes = sorted(r.status_code for r in answers)
        assert codes == [200, 409], [r.text for r in answers]
        won = next(i for i, r in enumerate(answers) if r.status_code == 200)
        assert answers[won].json()["run"] == "twice" and answers[won].json()["argv"][0] == "train"
        lost = answers[1 - won].json()["error"]
        assert lost.startswith("twice was started already (job ") and "choose another run.name" in lost
        saved = json.loads((trained / "runs/twice" / rv.UI_RUN).read_text())
        assert saved["overrides"] == bodies[won]["overrides"]
        r = c.post("/api/runs", json=bodies[1 - won])  # and again later, while it runs
        assert r.status_code == 409
    finally:
        for job in c.app.state.launcher.jobs.values():
            os.killpg(job["pid"], signal.SIGKILL)
            job["proc"].wait()
        shutil.rmtree(trained / "runs/twice", ignore_errors=True)


def test_finished_jobs_are_reaped_without_being_polled(client, trained) -> None:
    """Finding 8: a finished job's process is collected on the next request (no zombie), whether or
    not anyone asks for that job."""
    launcher = client.app.state.launcher
    job = launcher.start("version", ["--version"], trained / ".imglora-ui" / "version.log")
    try:
        _wait(lambda: psutil.Process(job["pid"]).status() == psutil.STATUS_ZOMBIE, 30, 0.05)  # exited, not reaped
        assert client.get("/api/runs").status_code == 200  # any request
        assert not psutil.pid_exists(job["pid"])
        with pytest.raises(ChildProcessError):
            os.waitpid(job["pid"], os.WNOHANG)  # collected already
        assert client.get(f"/api/jobs/{job['id']}").json()["returncode"] == 0
    finally:
        shutil.rmtree(trained / ".imglora-ui")
