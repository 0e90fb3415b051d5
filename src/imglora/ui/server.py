"""``imglora ui``: a web page over the run folders (FastAPI + uvicorn; the page is plain HTML and JS).

The UI is a view and a launcher: it reads what ``imglora train`` writes (run folders, ``log.jsonl``,
records, checkpoints, evaluation sheets) and starts the CLI's own commands as processes that outlive
the page (``train``, ``train --resume``, ``eval``, ``export``, ``fetch``, ``doctor``). Nothing is kept
anywhere else. Live updates are server-sent events (``/api/runs/{name}/events``).

Safety. It binds 127.0.0.1 by default (the SSH-forwarding case). Any other host needs ``--token``,
and then every request must carry it (``Authorization: Bearer``, or ``?token=`` once, which sets a
cookie). Files are served and written only inside the root: absolute paths, ``..`` and symlinks
that lead out of it are refused (403).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse

from . import runs as rv

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
STATIC = Path(__file__).parent / "static"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def inside(root: Path, relative: str) -> Path:
    """``root / relative`` when it stays inside ``root`` (symlinks resolved), else Refused(403)."""
    if not relative or relative.startswith(("/", "\\")) or Path(relative).is_absolute() or ":" in relative[:3]:
        raise Refused(403, f"{relative!r}: an absolute path; give a path inside the UI's root")
    if ".." in Path(relative).parts:
        raise Refused(403, f"{relative!r}: '..' is not allowed")
    path = (root / relative)
    try:
        resolved = path.resolve()
    except OSError as exc:
        raise Refused(404, f"{relative!r}: {exc}") from None
    if resolved != root and root not in resolved.parents:
        raise Refused(403, f"{relative!r} leads outside the UI's root (a symlink?)")
    return resolved


def as_sets(overrides: list[Any]) -> list[str]:
    """``KEY=VALUE`` overrides as the CLI's ``--set KEY=VALUE`` arguments."""
    return [x for o in overrides for x in ("--set", str(o))]


class Launcher:
    """CLI commands started as processes of their own session (they outlive the page and the server);
    their output goes to a log file the page tails."""

    def __init__(self, root: Path):
        self.root = root
        self.jobs: dict[str, dict[str, Any]] = {}

    def start(self, kind: str, argv: list[str], log: Path, cwd: Path | None = None) -> dict[str, Any]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "imglora", *argv], cwd=cwd or self.root, stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        job_id = secrets.token_hex(4)
        self.jobs[job_id] = {"id": job_id, "kind": kind, "argv": argv, "pid": proc.pid, "log": str(log),
                             "started": time.time(), "proc": proc}
        return self.view(job_id)

    def view(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            raise Refused(404, f"no job {job_id}")
        rc = job["proc"].poll()
        return {k: v for k, v in job.items() if k != "proc"} | {
            "running": rc is None, "returncode": rc, "tail": rv.tail(Path(job["log"]), 30)}


def create_app(root: str | os.PathLike, token: str | None = None, presets: str | os.PathLike | None = None) -> Any:
    root = Path(root).expanduser().resolve()
    preset_dir = Path(presets).expanduser().resolve() if presets else None
    app = FastAPI(title="imglora", docs_url=None, redoc_url=None, openapi_url=None)
    launcher = Launcher(root)
    app.state.launcher = launcher

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if token:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip() or \
                request.query_params.get("token") or request.cookies.get("imglora_token")
            if not given or not secrets.compare_digest(given, token):
                return JSONResponse({"error": "a token is needed: open the page with ?token=TOKEN"}, status_code=401)
        response = await call_next(request)  # (Refused is answered by the exception handler below)
        if token and request.query_params.get("token"):
            response.set_cookie("imglora_token", token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Any:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    def run_dir(name: str) -> Path:
        for run in rv.find_runs(root):
            if run.name == name:
                return run
        raise Refused(404, f"no run folder named {name!r} under {root}")

    # ------------------------------------------------------------------------------- pages
    @app.get("/", response_class=HTMLResponse)
    def index() -> Any:
        return HTMLResponse((STATIC / "index.html").read_text())

    @app.get("/static/{name}")
    def static(name: str) -> Any:
        path = inside(STATIC.resolve(), name)
        if not path.is_file():
            raise Refused(404, f"no {name}")
        return FileResponse(path)

    # ------------------------------------------------------------------------------- runs
    @app.get("/api/runs")
    def list_runs() -> Any:
        return {"root": str(root), "runs": [rv.summary(r, root) for r in rv.find_runs(root)]}

    @app.get("/api/runs/{name}")
    def run_detail(name: str) -> Any:
        return rv.detail(run_dir(name), root)

    @app.get("/api/runs/{name}/events")
    async def events(name: str, after: int = -1, once: bool = False) -> Any:
        run = run_dir(name)

        async def stream() -> Any:
            last, last_state = after, None
            while True:
                every = rv.log_rows(run)
                rows = [r for r in every if r.get("step", -1) > last]
                st = rv.summary(run, root, every)
                if rows or st["state"] != last_state:
                    last = rows[-1]["step"] if rows else last
                    last_state = st["state"]
                    payload = {"rows": rows, "summary": st, "tail": rv.tail(run / rv.UI_LOG, 40)}
                    yield f"data: {json.dumps(payload)}\n\n"
                if once:
                    return
                await asyncio.sleep(1.0)

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/api/runs/{name}/stop")
    def stop(name: str) -> Any:
        run = run_dir(name)
        owner = rv.lock_info(run)
        if owner is None:
            raise Refused(409, f"{name} is not running")
        if "train" not in str(owner.get("command", "")):
            raise Refused(409, f"{name}'s lock is held by {owner.get('command')!r}, not imglora train")
        os.kill(int(owner["pid"]), signal.SIGTERM)  # as Ctrl-C once: checkpoint, then stop (resumable)
        return {"stopping": name, "pid": owner["pid"]}

    @app.post("/api/runs/{name}/resume")
    def resume(name: str) -> Any:
        run = run_dir(name)
        st = rv.state(run)
        if not st["resumable"]:
            raise Refused(409, f"{name} is {st['state']}: nothing to resume")
        started = run / rv.UI_RUN
        if not started.is_file():
            raise Refused(409, f"{name} was not started from the UI; resume it with `imglora train PRESET --resume`")
        spec = json.loads(started.read_text())
        argv = ["train", spec["preset"], *as_sets(spec.get("overrides", [])), "--resume"]
        return launcher.start("resume", argv, run / rv.UI_LOG)

    @app.post("/api/runs")
    async def new_run(request: Request) -> Any:
        from ..commands.common import load_config
        from ..errors import ImgloraError

        body = await request.json()
        preset = _preset_path(body.get("preset", ""))
        overrides = [str(o) for o in body.get("overrides", [])]
        try:
            cfg = load_config(preset, overrides)
        except ImgloraError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        run = cfg.run_dir
        if not Path(run).is_absolute():
            run = (root / run).resolve()
        (run).mkdir(parents=True, exist_ok=True)
        if rv.lock_info(run) is not None:
            raise Refused(409, f"{run.name} is running already")
        (run / rv.UI_RUN).write_text(json.dumps({"preset": str(preset), "overrides": overrides}))
        argv = ["train", str(preset), *as_sets(overrides)]
        return {"run": run.name, **launcher.start("train", argv, run / rv.UI_LOG)}

    # ------------------------------------------------------------------------------- presets and config
    def _preset_path(name: str) -> Path:
        if preset_dir is None:
            raise Refused(404, "no presets folder (imglora ui --presets DIR)")
        path = inside(preset_dir, name)
        if not path.is_file() or path.suffix != ".toml":
            raise Refused(404, f"no preset {name!r} in {preset_dir}")
        return path

    @app.get("/api/presets")
    def list_presets() -> Any:
        return {"presets": sorted(p.name for p in preset_dir.glob("*.toml")) if preset_dir else []}

    @app.get("/api/schema")
    def schema(preset: str = "") -> Any:
        """The form: every key with its type, choices, range, default and help, and with ``preset``
        the value that preset gives it (TOML)."""
        from ..commands.common import load_config
        from ..config.keys import field_specs
        from ..errors import ImgloraError
        from ..families import registry

        cfg = None
        if preset:
            try:
                cfg = load_config(_preset_path(preset), [])
            except ImgloraError as exc:
                return JSONResponse({"error": str(exc)}, status_code=422)
        return {"keys": field_specs(registry, cfg)}

    @app.post("/api/check")
    async def check(request: Request) -> Any:
        """The configuration's problems, all at once, exactly as `imglora config` reports them."""
        from ..commands.common import load_config
        from ..errors import ImgloraError

        body = await request.json()
        preset = _preset_path(body.get("preset", ""))
        try:
            cfg = load_config(preset, [str(o) for o in body.get("overrides", [])])
        except ImgloraError as exc:
            return {"ok": False, "problems": str(exc)}
        return {"ok": True, "problems": "", "toml": cfg.to_toml(), "notes": list(cfg.notes)}

    plans: dict[tuple[Any, ...], tuple[Any, str]] = {}  # (preset, overrides, card, mtime): (plan, its text)

    def plan_for(preset: Path, overrides: tuple[str, ...], card: str) -> tuple[Any, str]:
        """The plan for ``card`` and its printed table, made once (Plan and Estimate share it)."""
        from ..commands import plan as plan_cmd

        key = (str(preset), overrides, card, preset.stat().st_mtime_ns)  # (an edited preset: a new plan)
        if key not in plans:
            lines: list[str] = []
            p = plan_cmd.run(str(preset), overrides, blocks=None, resolution=None, vram=None, host_ram=None,
                             bench_file=None, device="cuda", json_out=None, out=lines.append, gpu=card)
            plans[key] = p, "\n".join(lines)
        return plans[key]

    @app.post("/api/plan")
    async def plan(request: Request) -> Any:
        from ..errors import ImgloraError

        body = await request.json()
        preset = _preset_path(body.get("preset", ""))
        try:
            p, text = await asyncio.to_thread(plan_for, preset, tuple(body.get("overrides", [])),
                                              body.get("gpu") or "h200")
        except ImgloraError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        return {"text": text, "plan": p.to_dict()}

    @app.post("/api/estimate")
    async def estimate(request: Request) -> Any:
        """Hours and cost per GPU offer entered (NAME:RATE[:SEC_PER_UPDATE]), at the plan's speed for the
        card the offer names (else the card chosen), for the preset's updates."""
        from ..commands.common import load_config
        from ..errors import ImgloraError
        from . import costs

        body = await request.json()
        preset = _preset_path(body.get("preset", ""))
        overrides = tuple(str(o) for o in body.get("overrides", []))
        offers = [o for o in (str(x).strip() for x in body.get("offers", [])) if o]
        try:
            cfg = load_config(preset, list(overrides))
            steps = int(body.get("steps") or 0) or cfg.train.max_steps
            if not steps:
                raise ImgloraError(f"{preset.name}: train.max_steps is 0 (the run counts epochs, so its updates depend "
                                   "on the dataset's batches); enter the number of updates")
            if not offers:
                raise ImgloraError("no offer: enter one per line as NAME:RATE or NAME:RATE:SEC_PER_UPDATE, e.g. "
                                   "runpod-h100:2.99 (the card is read from the name)")
            idle = float(body.get("idle_minutes") or 0)
            currency = cfg.train.budget.currency
            rows = await asyncio.to_thread(costs.offer_rows, offers, body.get("gpu") or "h200", steps,
                                           cfg.train.checkpoint_every, idle, currency,
                                           lambda card: plan_for(preset, overrides, card)[0])
        except (ImgloraError, ValueError) as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        return {"steps": steps, "currency": currency, "idle_minutes": idle, "offers": [r.to_dict() for r in rows],
                "note": "training updates at the speed shown, plus the idle minutes entered (boot, model download, "
                        "caching, checkpoint saves and evaluation are not measured before a first run: "
                        "`imglora estimate RUN_DIR` measures them from one)"}

    # ------------------------------------------------------------------------------- dataset
    @app.get("/api/dataset")
    def dataset(dir: str, mask_dir: str = "", control_dir: str = "") -> Any:
        """The folder's images with their captions, the scan's warnings beside the images they name, and
        with ``mask_dir``/``control_dir`` (data.sets[].mask_dir, control_dir) each image's loss mask
        and source images, found as training finds them, for the page to overlay."""
        from ..data.controls import attach_controls
        from ..data.dataset import _find_images, scan_dataset
        from ..data.masks import attach_masks
        from ..errors import DataError

        folder = inside(root, dir)
        masks = inside(root, mask_dir) if mask_dir else None
        controls = inside(root, control_dir) if control_dir else None
        warnings: list[str] = []
        try:
            images = [p for p, _ in _find_images(folder, 1, warnings, "dir")]
            result = scan_dataset(folder, resolution=1024, step=64, missing_caption="default", skip_bad_images=True)
        except DataError as exc:
            raise Refused(422, str(exc)) from None
        scanned, problems = list(result.warnings), []
        found = list(result.items)  # checked as training checks them: the mask's size, an all-black mask ...
        if masks is not None:
            found = attach_masks(found, folder, masks, "mask_dir", problems, scanned)
        mask_of = {item.path: item.mask for item in found}
        if controls is not None:
            found = attach_controls(found, folder, controls, "control_dir", 8, problems, scanned)
        controls_of = {item.path: item.controls for item in found}

        def rel(path: Path | None) -> str | None:
            return rv.inside_root(path, root)

        def names(message: str, image: Path) -> bool:  # the file's path, or its name as a word of its own
            return str(image) in message or re.search(rf"(?<![\w/.-]){re.escape(image.name)}(?![\w.-])", message) is not None

        items = []
        for image in images:
            cap = image.with_suffix(".txt")
            text = cap.read_text(encoding="utf-8-sig", errors="replace").strip() if cap.is_file() else ""
            items.append({"image": rel(image), "caption": text, "caption_file": rel(cap),
                          "mask": rel(mask_of.get(image)),
                          "controls": [c for c in map(rel, controls_of.get(image, ())) if c],
                          "warnings": [w for w in problems + scanned if names(w, image)]})
        return {"dir": dir, "mask_dir": mask_dir, "control_dir": control_dir, "items": items,
                "problems": problems, "warnings": scanned}

    @app.put("/api/caption")
    async def put_caption(request: Request) -> Any:
        from .. import atomic

        body = await request.json()
        image = inside(root, str(body.get("image", "")))
        if image.suffix.lower() not in IMAGE_SUFFIXES or not image.is_file():
            raise Refused(404, f"{body.get('image')!r}: not an image in the root")
        text = " ".join(str(body.get("caption", "")).split())
        atomic.write_text(image.with_suffix(".txt"), text + "\n")  # a new caption: a new cache key
        return {"image": str(image.relative_to(root)), "caption": text}

    # ------------------------------------------------------------------------------- files
    @app.get("/files/{relative:path}")
    def files(relative: str) -> Any:
        path = inside(root, relative)
        if not path.is_file():
            raise Refused(404, f"no file {relative!r}")
        return FileResponse(path, filename=path.name if path.suffix == ".safetensors" else None)

    # ------------------------------------------------------------------------------- eval, export, fetch, doctor
    @app.post("/api/runs/{name}/eval")
    def evaluate(name: str) -> Any:
        run = run_dir(name)
        return launcher.start("eval", ["eval", str(run), "--all-checkpoints"], run / "ui-eval.log")

    @app.post("/api/runs/{name}/export")
    async def export(name: str, request: Request) -> Any:
        run = run_dir(name)
        body = await request.json()
        comfy = str(body.get("comfyui") or "")
        argv = ["export", str(run)] + (["--comfyui", str(inside(root, comfy))] if comfy else [])
        return launcher.start("export", argv, run / "ui-export.log")

    @app.post("/api/cache")
    async def cache(request: Request) -> Any:
        """``imglora cache-latents PRESET --set ...``: latents and text encoded once, before renting time
        for training (its progress lines in the job's output)."""
        body = await request.json()
        preset = _preset_path(body.get("preset", ""))
        return launcher.start("cache", ["cache-latents", str(preset), *as_sets(body.get("overrides", []))],
                              root / ".imglora-ui" / "cache-latents.log")

    @app.post("/api/fetch")
    async def fetch(request: Request) -> Any:
        body = await request.json()
        preset = _preset_path(body.get("preset", ""))
        argv = ["fetch", str(preset)] + (["--dry-run"] if body.get("dry_run") else [])
        return launcher.start("fetch", argv, root / ".imglora-ui" / "fetch.log")

    @app.post("/api/doctor")
    async def doctor(request: Request) -> Any:
        body = await request.json()
        preset = body.get("preset")
        argv = ["doctor"] + ([str(_preset_path(preset))] if preset else [])
        return launcher.start("doctor", argv, root / ".imglora-ui" / "doctor.log")

    @app.get("/api/jobs/{job_id}")
    def job(job_id: str) -> Any:
        return launcher.view(job_id)

    return app


def serve(root: str, host: str = "127.0.0.1", port: int = 7860, token: str | None = None,
          presets: str | None = None) -> None:
    from ..errors import ImgloraError

    if host not in LOCAL_HOSTS and not token:
        raise ImgloraError(f"--host {host}: the UI would be reachable from other machines; give --token TOKEN "
                           "(every request must then carry it), or keep the default 127.0.0.1 and forward the port "
                           "over SSH (ssh -L 7860:127.0.0.1:7860 box)")
    import uvicorn
    app = create_app(root, token, presets)
    print(f"imglora ui: http://{host}:{port}/" + (f"?token={token}" if token else "") + f" (root {Path(root).resolve()})")
    uvicorn.run(app, host=host, port=port, log_level="warning")
