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


def test_plan_for_a_card(client) -> None:
    r = client.post("/api/plan", json={"preset": "tiny-flux.toml", "overrides": [], "gpu": "4090"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert "peak allocated" in body["text"] and body["plan"]["settings"]


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
    ev = finished(client.post("/api/runs/done/eval").json())
    assert ev["argv"][:2] == ["eval", str(trained / "runs" / "done")] and ev["returncode"] == 0, ev["tail"]
    d = client.get("/api/runs/done").json()
    assert any(p.endswith("contact_sheet.png") for p in d["sheets"]) and d["evals"]
