"""``imglora ui``: a web page over the run folders (FastAPI + uvicorn; the page is plain HTML and JS).

The UI is a view and a launcher: it reads what ``imglora train`` writes (run folders, ``log.jsonl``,
records, checkpoints, evaluation sheets) and starts the CLI's own commands as processes that outlive
the page (``train``, ``train --resume``, ``eval``, ``export``, ``fetch``, ``doctor``). Nothing is kept
anywhere else. Live updates are server-sent events (``/api/runs/{name}/events``).

Safety, as Jupyter Server's defaults (every rule answered by ``guard.Guard``, before any endpoint):

- A token, localhost included: ``imglora ui`` prints one URL with ``?token=``; opening it swaps the
  token for an HTTP-only cookie and redirects to the clean URL (the token leaves the address bar and
  history). Scripts send ``Authorization: Bearer TOKEN``. ``--no-token`` (localhost only) opts out.
- A Host allowlist against DNS rebinding: localhost names, the bound address and ``--allow-host``
  names; any other Host header gets 403.
- Every state-changing request (POST, PUT, PATCH, DELETE) must come from the page itself: a foreign
  ``Origin`` or a ``Sec-Fetch-Site`` other than same-origin is refused, and the page echoes its
  XSRF cookie in an ``X-XSRF-Token`` header (double submit, compared in constant time; a request
  with the token in its Authorization header needs none). A body is JSON only (415 otherwise), at
  most ``MAX_BODY`` bytes (413).
- The page is sent with a Content-Security-Policy (scripts from the server only, no inline script),
  ``X-Frame-Options: DENY`` and ``Referrer-Policy: no-referrer``; files under the root (``/files``)
  with ``Content-Security-Policy: sandbox`` and ``nosniff``, and anything but images and plain text
  as an attachment.
- Files are served, read and written only inside the root: absolute paths, ``..`` and symlinks
  that lead out of it are refused (403), and so are output folders set outside it (422).
- Stop signals a process only when ``runlock.process_matches`` says the lock's pid is the live
  imglora run on this host that the lock describes (409 with the reason otherwise).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, StreamingResponse

from . import run_folders as rv
from .guard import (LOCAL_HOSTS, Guard, Refused, check_token, clean_overrides, field, links_out, short,
                    inside, is_inside, read_json, ui_url)
from .jobs import Launcher, as_sets

STATIC = Path(__file__).parent / "static"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
MAX_CAPTION = 64 * 1024  # bytes of a caption
# /files shows these in the browser (the page's images, text); anything else is a download
INLINE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
                ".txt": "text/plain; charset=utf-8", ".log": "text/plain; charset=utf-8",
                ".jsonl": "text/plain; charset=utf-8", ".toml": "text/plain; charset=utf-8",
                ".csv": "text/plain; charset=utf-8", ".json": "application/json"}
# outputs a configuration names: the UI starts nothing that writes outside its root
OUTPUT_KEYS = ("run.output_dir", "cache.dir", "export.comfyui_dir")


def create_app(root: str | os.PathLike, token: str | None, presets: str | os.PathLike | None = None, *,
               host: str = "127.0.0.1", allow_hosts: tuple[str, ...] | list[str] = ()) -> Any:
    """The app. ``token``: asked of every request (None: none, as ``--no-token``); ``host``: the
    address it is bound to; ``allow_hosts``: other names it answers to (a tunnel's, a proxy's)."""
    root = Path(root).expanduser().resolve()
    preset_dir = Path(presets).expanduser().resolve() if presets else None
    app = FastAPI(title="imglora", docs_url=None, redoc_url=None, openapi_url=None)
    launcher = Launcher(root)
    app.state.launcher = launcher
    guard = Guard(token, host, allow_hosts, before=launcher.reap)
    app.middleware("http")(guard)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Any:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    def run_dir(name: str) -> Path:
        for run in rv.find_runs(root):
            if run.name == name:
                return run
        raise Refused(404, f"no run folder named {short(name)} under {root}")

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
        return {"root": str(root), "runs": [rv.safe_summary(r, root) for r in rv.find_runs(root)]}

    @app.get("/api/runs/{name}")
    def run_detail(name: str) -> Any:
        run = run_dir(name)
        try:
            return rv.detail(run, root)
        except Exception as exc:  # a file of the run that does not read: the run, not the server
            return rv.safe_summary(run, root) | {"error": f"{name}: {rv.unreadable(exc)}", "rows": [], "smoothed": [],
                                                  "tail": [], "sheets": [], "evals": [], "eval_losses": None,
                                                  "adapter": None, "exports": []}

    @app.get("/api/runs/{name}/events")
    async def events(name: str, after: int = -1, once: bool = False) -> Any:
        run = run_dir(name)

        async def stream() -> Any:
            last, last_state = after, None
            while True:
                every = rv.log_rows(run)
                rows = [r for r in every if r["step"] > last]
                st = rv.safe_summary(run, root, every)
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
        from ..training.runlock import process_matches

        run = run_dir(name)
        owner = rv.lock_record(run)
        if owner is None:
            raise Refused(409, f"{name} is not running (its lock names no process)")
        why = process_matches(owner)
        if why is not None:
            raise Refused(409, f"{name}: not stopping pid {owner.get('pid')!r}: {why}")
        if "train" not in str(owner.get("command", "")):
            raise Refused(409, f"{name}'s lock is held by {owner.get('command')!r}, not imglora train")
        os.kill(int(owner["pid"]), signal.SIGTERM)  # as Ctrl-C once: checkpoint, then stop (resumable)
        return {"stopping": name, "pid": owner["pid"]}

    def busy(run: Path) -> None:
        """409 while ``run`` is running or a start of it is under way (checked under ``launcher.lock``):
        a job started for it that has not yet taken the run's lock (a process that took it and let it
        go is finishing: no longer in the way)."""
        from ..training.runlock import LOCK_NAME

        job = launcher.active_for(run)
        try:
            locked_since_start = (run / LOCK_NAME).stat().st_mtime >= job["started"] if job else False
        except OSError:
            locked_since_start = False
        if job is not None and not locked_since_start:
            raise Refused(409, f"{run.name} was started already (job {job['id']}, pid {job['pid']}, still running); "
                               "wait for it, or choose another run.name")
        if rv.lock_info(run) is not None:
            raise Refused(409, f"{run.name} is running already")

    @app.post("/api/runs/{name}/resume")
    def resume(name: str) -> Any:
        from ..commands.common import load_config
        from ..errors import ImgloraError

        run = run_dir(name)
        st = rv.state(run)
        if not st["resumable"]:
            raise Refused(409, f"{name} is {st['state']}: nothing to resume")
        started = run / rv.UI_RUN
        if not started.is_file():
            raise Refused(409, f"{name} was not started from the UI; resume it with `imglora train PRESET --resume`")
        try:
            spec = json.loads(started.read_text())
            preset, overrides = str(spec["preset"]), clean_overrides(spec.get("overrides", []))
            cfg = load_config(preset, overrides)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, ImgloraError) as exc:
            raise Refused(422, f"{name}: {rv.UI_RUN} does not give a configuration ({exc})") from None
        check_outputs(cfg)
        with launcher.lock:
            busy(run)
            argv = ["train", preset, *as_sets(overrides), "--resume"]
            return launcher.start("resume", argv, run / rv.UI_LOG, run=run)

    def check_outputs(cfg: Any) -> Path:
        """422 naming the key when an output folder of ``cfg`` (relative: to the root, where the UI runs
        commands) leads outside the root; else the run folder, resolved."""
        for key in OUTPUT_KEYS:
            section, name = key.split(".")
            value = getattr(getattr(cfg, section), name, "")
            if not value:
                continue
            if "\x00" in str(value):
                raise Refused(422, f"{key}: a NUL byte in {short(value)}")
            path = Path(str(value)).expanduser()
            resolved = (path if path.is_absolute() else root / path).resolve()
            if not is_inside(resolved, root):
                raise Refused(422, f"{key} = {str(value)!r} is {resolved}, outside the UI's root {root}: the UI writes "
                                   "only inside its root; give a folder inside it (a relative path is relative to "
                                   "the root)")
        run = Path(cfg.run_dir)
        run = (run if run.is_absolute() else root / run).resolve()
        if not is_inside(run, root) or run == root:
            raise Refused(422, f"run.name = {cfg.run.name!r}: the run folder {run} is not inside the UI's root {root}; "
                               "give a plain folder name")
        return run

    def config_of(body: dict[str, Any]) -> tuple[Path, list[str], Any]:
        from ..commands.common import load_config
        from ..errors import ImgloraError

        preset = _preset_path(field(body, "preset", str, ""))
        overrides = clean_overrides(body.get("overrides"))
        try:
            return preset, overrides, load_config(preset, overrides)
        except ImgloraError as exc:
            raise Refused(422, str(exc)) from None

    @app.post("/api/runs")
    async def new_run(request: Request) -> Any:
        preset, overrides, cfg = config_of(await read_json(request))
        run = check_outputs(cfg)
        with launcher.lock:  # the check and the start as one: a second start of the name is refused
            busy(run)
            run.mkdir(parents=True, exist_ok=True)
            (run / rv.UI_RUN).write_text(json.dumps({"preset": str(preset), "overrides": overrides}))
            argv = ["train", str(preset), *as_sets(overrides)]
            return {"run": run.name, **launcher.start("train", argv, run / rv.UI_LOG, run=run)}

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
        """The configuration's problems, all at once, exactly as `imglora config` reports them (and an
        output folder outside the root, which the UI would refuse to start)."""
        from ..commands.common import load_config
        from ..errors import ImgloraError

        body = await read_json(request)
        preset = _preset_path(field(body, "preset", str, ""))
        try:
            cfg = load_config(preset, clean_overrides(body.get("overrides")))
        except ImgloraError as exc:
            return {"ok": False, "problems": str(exc)}
        try:
            check_outputs(cfg)
        except Refused as exc:
            return {"ok": False, "problems": exc.message}
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

        body = await read_json(request)
        preset = _preset_path(field(body, "preset", str, ""))
        overrides, card = tuple(clean_overrides(body.get("overrides"))), field(body, "gpu", str) or "h200"
        try:
            p, text = await asyncio.to_thread(plan_for, preset, overrides, card)
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

        body = await read_json(request)
        preset = _preset_path(field(body, "preset", str, ""))
        overrides = tuple(clean_overrides(body.get("overrides")))
        offers_in = field(body, "offers", list, [])
        if not all(isinstance(x, str) for x in offers_in):
            raise Refused(422, f"offers: expected a list of NAME:RATE strings, got {short(offers_in)}")
        offers = [o for o in (x.strip() for x in offers_in) if o]
        card = field(body, "gpu", str) or "h200"
        try:
            cfg = load_config(preset, list(overrides))
            steps = field(body, "steps", int) or cfg.train.max_steps
            if not steps:
                raise ImgloraError(f"{preset.name}: train.max_steps is 0 (the run counts epochs, so its updates depend "
                                   "on the dataset's batches); enter the number of updates")
            if not offers:
                raise ImgloraError("no offer: enter one per line as NAME:RATE or NAME:RATE:SEC_PER_UPDATE, e.g. "
                                   "runpod-h100:2.99 (the card is read from the name)")
            idle = float(field(body, "idle_minutes", (int, float), 0))
            currency = cfg.train.budget.currency
            rows = await asyncio.to_thread(costs.offer_rows, offers, card, steps,
                                           cfg.train.checkpoint_every, idle, currency,
                                           lambda c: plan_for(preset, overrides, c)[0])
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
        and source images, found as training finds them, for the page to overlay. A folder holding an
        entry whose real path leaves the root (a symlinked caption, image or mask) is not read (403
        naming it), as nothing is written through one."""
        from ..data.controls import attach_controls
        from ..data.dataset import _find_images, scan_dataset
        from ..data.masks import attach_masks
        from ..errors import DataError

        folder = inside(root, dir)
        masks = inside(root, mask_dir) if mask_dir else None
        controls = inside(root, control_dir) if control_dir else None
        for key, base in (("dir", folder), ("mask_dir", masks), ("control_dir", controls)):
            out = links_out(base, root) if base is not None else []
            if out:
                shown = ", ".join(str(p.relative_to(root)) for p in out[:5]) + (" ..." if len(out) > 5 else "")
                raise Refused(403, f"{key}: {shown} {'lead' if len(out) > 1 else 'leads'} outside the UI's root (a "
                                   "symlink); the UI reads nothing there: copy the file into the root instead of "
                                   "linking it")
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
            text = cap.read_bytes()[:MAX_CAPTION].decode("utf-8-sig", errors="replace").strip() if cap.is_file() else ""
            items.append({"image": rel(image), "caption": text, "caption_file": rel(cap),
                          "mask": rel(mask_of.get(image)),
                          "controls": [c for c in map(rel, controls_of.get(image, ())) if c],
                          "warnings": [w for w in problems + scanned if names(w, image)]})
        return {"dir": dir, "mask_dir": mask_dir, "control_dir": control_dir, "items": items,
                "problems": problems, "warnings": scanned}

    @app.put("/api/caption")
    async def put_caption(request: Request) -> Any:
        from ..util import atomic

        body = await read_json(request, limit=MAX_CAPTION + 4096)
        name, caption = field(body, "image", str, ""), field(body, "caption", str, "")
        if len(caption.encode("utf-8", "surrogatepass")) > MAX_CAPTION:
            raise Refused(413, f"the caption of {name!r} is {len(caption.encode('utf-8', 'surrogatepass'))} bytes; "
                               f"at most {MAX_CAPTION}")
        if "\x00" in caption:
            raise Refused(422, f"caption: a NUL byte in the caption of {name!r}")
        image = inside(root, name)
        if image.suffix.lower() not in IMAGE_SUFFIXES or not image.is_file():
            raise Refused(404, f"{name!r}: not an image in the root")
        text = " ".join(caption.split())
        atomic.write_text(image.with_suffix(".txt"), text + "\n")  # a new caption: a new cache key
        return {"image": str(image.relative_to(root)), "caption": text}

    # ------------------------------------------------------------------------------- files
    @app.get("/files/{relative:path}")
    def files(relative: str) -> Any:
        path = inside(root, relative)
        if not path.is_file():
            raise Refused(404, f"no file {relative!r}")
        kind = INLINE_TYPES.get(path.suffix.lower())
        if kind is not None:  # images and plain text, shown in the browser (sandboxed, not sniffed)
            return FileResponse(path, media_type=kind)
        return FileResponse(path, filename=path.name, media_type="application/octet-stream",
                            content_disposition_type="attachment")

    # ------------------------------------------------------------------------------- eval, export, fetch, doctor
    @app.post("/api/runs/{name}/eval")
    async def evaluate(name: str, request: Request) -> Any:
        await read_json(request)
        run = run_dir(name)
        return launcher.start("eval", ["eval", str(run), "--all-checkpoints"], run / "ui-eval.log")

    @app.post("/api/runs/{name}/export")
    async def export(name: str, request: Request) -> Any:
        run = run_dir(name)
        body = await read_json(request)
        comfy = field(body, "comfyui", str, "")
        argv = ["export", str(run)] + (["--comfyui", str(inside(root, comfy))] if comfy else [])
        return launcher.start("export", argv, run / "ui-export.log")

    @app.post("/api/cache")
    async def cache(request: Request) -> Any:
        """``imglora cache-latents PRESET --set ...``: latents and text encoded once, before renting time
        for training (its progress lines in the job's output)."""
        preset, overrides, cfg = config_of(await read_json(request))
        check_outputs(cfg)
        return launcher.start("cache", ["cache-latents", str(preset), *as_sets(overrides)],
                              root / ".imglora-ui" / "cache-latents.log")

    @app.post("/api/fetch")
    async def fetch(request: Request) -> Any:
        body = await read_json(request)
        preset = _preset_path(field(body, "preset", str, ""))
        argv = ["fetch", str(preset)] + (["--dry-run"] if field(body, "dry_run", bool, False) else [])
        return launcher.start("fetch", argv, root / ".imglora-ui" / "fetch.log")

    @app.post("/api/doctor")
    async def doctor(request: Request) -> Any:
        body = await read_json(request)
        preset = field(body, "preset", str, "")
        argv = ["doctor"] + ([str(_preset_path(preset))] if preset else [])
        return launcher.start("doctor", argv, root / ".imglora-ui" / "doctor.log")

    @app.get("/api/jobs/{job_id}")
    def job(job_id: str) -> Any:
        return launcher.view(job_id)

    return app


def serve(root: str, host: str = "127.0.0.1", port: int = 7860, token: str | None = None,
          presets: str | None = None, *, no_token: bool = False, allow_hosts: tuple[str, ...] = (),
          out: Any = print) -> None:
    """Serve the UI. Without ``token`` a new one is made and printed (in the URL that logs a browser
    in), unless ``no_token`` (localhost only)."""
    from ..errors import ImgloraError

    if no_token and token:
        raise ImgloraError("--no-token and --token contradict each other; give one of them")
    if no_token and host not in LOCAL_HOSTS:
        raise ImgloraError(f"--host {host}: the UI would be reachable from other machines; --no-token is only for "
                           "127.0.0.1 (keep the printed token, or forward the port over SSH: "
                           "ssh -L 7860:127.0.0.1:7860 box)")
    if token:
        check_token(token)
    elif not no_token:
        token = secrets.token_urlsafe(32)
    import uvicorn
    app = create_app(root, token, presets, host=host, allow_hosts=tuple(allow_hosts))
    if no_token:
        out("warning: --no-token: any program or user on this machine can reach the UI and start or stop runs "
            "and rewrite captions through it; use this only on a machine that is yours alone")
    out(f"imglora ui: open {ui_url(host, port, token)} (root {Path(root).resolve()})")
    uvicorn.run(app, host=host, port=port, log_level="warning")
