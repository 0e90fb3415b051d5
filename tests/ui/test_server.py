"""``imglora ui``'s server: every endpoint, on real run folders written by a tiny training run, and
its refusals (token, paths outside the root, symlinks out of it, actions that do not apply)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from comfy_tree import fake_comfyui  # noqa: E402

from imglora.errors import ImgloraError  # noqa: E402
from imglora.ui import runs as rv  # noqa: E402
from imglora.ui.server import create_app, serve  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PRESETS = REPO / "presets"


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
    return TestClient(create_app(trained, presets=PRESETS))


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
    c = TestClient(create_app(trained, token="s3cret", presets=PRESETS))
    assert c.get("/api/runs").status_code == 401 and c.get("/").status_code == 401
    assert "?token=TOKEN" in c.get("/api/runs").json()["error"]
    assert c.get("/api/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert c.get("/api/runs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    r = c.get("/?token=s3cret")
    assert r.status_code == 200 and "imglora_token" in r.cookies
    assert c.get("/api/runs").status_code == 200  # the cookie now
    with pytest.raises(ImgloraError, match="--host 0.0.0.0: the UI would be reachable from other machines; give "
                                           "--token"):
        serve(str(trained), host="0.0.0.0")


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
    c = TestClient(create_app(trained, presets=presets))
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
    c = TestClient(create_app(root, presets=PRESETS))
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
    c = TestClient(create_app(trained, presets=PRESETS))
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
