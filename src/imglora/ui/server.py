"""``imglora ui``: a web page over the run folders (FastAPI + uvicorn; the page is plain HTML and JS).

The UI is a view and a launcher: it reads what ``imglora train`` writes (run folders, ``log.jsonl``,
records, checkpoints, evaluation sheets) and starts the CLI's own commands as processes that outlive
the page (``train``, ``train --resume``, ``eval``, ``export``, ``fetch``, ``doctor``). Nothing is kept
anywhere else. Live updates are server-sent events (``/api/runs/{name}/events``).

Safety, as Jupyter Server's defaults (every rule answered by ``guard`` below, before any endpoint):

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
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, StreamingResponse

from . import runs as rv

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
STATIC = Path(__file__).parent / "static"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")

# Cookie names end with the port the browser sees ("imglora_token_7860"): a browser keeps one cookie jar
# for every port of a host, so two UIs on one machine would otherwise log each other out.
TOKEN_COOKIE = "imglora_token"
XSRF_COOKIE = "imglora_xsrf"  # readable by the page's script, which sends it back in XSRF_HEADER
XSRF_HEADER = "x-xsrf-token"
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")
MAX_BODY = 1 << 20  # bytes of a request body
MAX_CAPTION = 64 * 1024  # bytes of a caption
MAX_NAME = 255  # bytes of one path component (the file systems' limit)
MAX_PATH = 4096

PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
            "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
FILES_CSP = "sandbox; default-src 'none'; img-src 'self'; style-src 'unsafe-inline'"
# /files shows these in the browser (the page's images, text); anything else is a download
INLINE_TYPES = {".png": "image/png", ".jpg": "image/jpeg", ".jpeg": "image/jpeg", ".webp": "image/webp",
                ".txt": "text/plain; charset=utf-8", ".log": "text/plain; charset=utf-8",
                ".jsonl": "text/plain; charset=utf-8", ".toml": "text/plain; charset=utf-8",
                ".csv": "text/plain; charset=utf-8", ".json": "application/json"}
# outputs a configuration names: the UI starts nothing that writes outside its root
OUTPUT_KEYS = ("run.output_dir", "cache.dir", "export.comfyui_dir")


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _short(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "...'"


def check_path_text(relative: str, what: str = "path") -> None:
    """Refuse (400) a path no file system takes: a NUL byte, a component over 255 bytes, over 4096 in all."""
    if "\x00" in relative:
        raise Refused(400, f"{_short(relative)}: a NUL byte in the {what}; give a plain path inside the UI's root")
    if len(relative.encode("utf-8", "surrogatepass")) > MAX_PATH:
        raise Refused(400, f"{_short(relative)}: a {what} of {len(relative)} characters; at most {MAX_PATH} bytes")
    for part in re.split(r"[/\\]", relative):
        if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME:
            raise Refused(400, f"{_short(part)}: a name of {len(part.encode('utf-8', 'surrogatepass'))} bytes in the "
                               f"{what}; a file or folder name has at most {MAX_NAME}")


def inside(root: Path, relative: str) -> Path:
    """``root / relative`` when it stays inside ``root`` (symlinks resolved), else Refused(403)."""
    check_path_text(relative)
    if not relative or relative.startswith(("/", "\\")) or Path(relative).is_absolute() or ":" in relative[:3]:
        raise Refused(403, f"{relative!r}: an absolute path; give a path inside the UI's root")
    if ".." in Path(relative).parts:
        raise Refused(403, f"{relative!r}: '..' is not allowed")
    path = (root / relative)
    try:
        resolved = path.resolve()
    except (OSError, RuntimeError) as exc:
        raise Refused(404, f"{relative!r}: {exc}") from None
    if not is_inside(resolved, root):
        raise Refused(403, f"{relative!r} leads outside the UI's root (a symlink?)")
    return resolved


def is_inside(resolved: Path, root: Path) -> bool:
    return resolved == root or root in resolved.parents


def as_sets(overrides: list[Any]) -> list[str]:
    """``KEY=VALUE`` overrides as the CLI's ``--set KEY=VALUE`` arguments."""
    return [x for o in overrides for x in ("--set", str(o))]


def clean_overrides(values: Any, key: str = "overrides") -> list[str]:
    """The form's ``KEY=VALUE`` lines, each one line (a line break would end the value early, and what
    follows it would be lost or read as another key): else 422 naming the key."""
    if values is None:
        return []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise Refused(422, f"{key}: expected a list of KEY=VALUE strings, got {_short(values)}")
    for value in values:
        name = value.split("=", 1)[0].strip() or value
        if "\n" in value or "\r" in value or "\x00" in value:
            what = "a NUL byte" if "\x00" in value else "a line break"
            raise Refused(422, f"{name}: {what} in its value ({_short(value)}); a value must be one line (a TOML "
                               "string writes a line break as \\n)")
    return values


def field(body: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """``body[key]`` when it has the type the endpoint takes (None: the default), else 422 naming it."""
    value = body.get(key)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join({str: "a string", bool: "true or false", int: "an integer", float: "a number",
                             list: "a list"}.get(k, k.__name__) for k in kinds)
        raise Refused(422, f"{key}: expected {names}, got {_short(value)}")
    return value


async def read_json(request: Request, limit: int = MAX_BODY) -> dict[str, Any]:
    """The request's JSON object (an empty body: ``{}``); 413 over ``limit``, 415 when not JSON by its
    Content-Type, 400 when it does not parse, 422 when it is not an object."""
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise Refused(413, f"the request body is over {limit} bytes")
    if not raw.strip():
        return {}
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype != "application/json":
        raise Refused(415, f"Content-Type {ctype or '(none)'!r}: send the body as application/json")
    try:
        body = json.loads(raw)
    except ValueError as exc:  # (UnicodeDecodeError too)
        raise Refused(400, f"the body is not valid JSON ({exc}); send one JSON object") from None
    if not isinstance(body, dict):
        raise Refused(422, f"the body is JSON {type(body).__name__}; send one JSON object")
    return body


def _ascii_token(given: str, token: str) -> bool:
    """``given == token`` in constant time, for any text (a non-ASCII one is simply not the token)."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode("utf-8", "surrogatepass"))


def host_name(header: str) -> str:
    """The name in a Host (or Origin netloc) header, without port or IPv6 brackets, lower case."""
    h = header.strip().lower()
    if h.startswith("["):
        return h[1:h.index("]")] if "]" in h else h
    return (h.rsplit(":", 1)[0] if h.count(":") == 1 else h).rstrip(".")


def host_port(header: str) -> str:
    """The port in a Host header ("" when it names none)."""
    h = header.strip()
    tail = h[h.index("]") + 1:] if h.startswith("[") and "]" in h else h
    return tail.rsplit(":", 1)[1] if tail.count(":") == 1 and tail.rsplit(":", 1)[1].isdigit() else ""


def cookie_names(host_header: str) -> tuple[str, str]:
    """The token cookie's and the XSRF cookie's names for a request to ``host_header``."""
    port = host_port(host_header)
    return f"{TOKEN_COOKIE}_{port}", f"{XSRF_COOKIE}_{port}"


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def ui_url(host: str, port: int, token: str | None, path: str = "/") -> str:
    """The address ``imglora ui`` prints: with the token, the link that logs the browser in."""
    shown = "127.0.0.1" if host in WILDCARD_HOSTS else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"http://{shown}:{port}{path}" + (f"?{urlencode({'token': token})}" if token else "")


class Launcher:
    """CLI commands started as processes of their own session (they outlive the page and the server);
    their output goes to a log file the page tails. Finished ones are reaped on every request (no
    zombies), and a run folder has at most one start under way (``lock`` around check and start)."""

    def __init__(self, root: Path):
        self.root = root
        self.jobs: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def start(self, kind: str, argv: list[str], log: Path, cwd: Path | None = None,
              run: Path | None = None) -> dict[str, Any]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as fh:
            proc = subprocess.Popen([sys.executable, "-m", "imglora", *argv], cwd=cwd or self.root, stdout=fh,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        job_id = secrets.token_hex(4)
        self.jobs[job_id] = {"id": job_id, "kind": kind, "argv": argv, "pid": proc.pid, "log": str(log),
                             "started": time.time(), "run_dir": str(run) if run else None, "proc": proc}
        return self.view(job_id)

    def reap(self) -> None:
        """Collect every finished job's exit status (so none stays a zombie)."""
        for job in list(self.jobs.values()):
            job["proc"].poll()

    def active_for(self, run: Path) -> dict[str, Any] | None:
        """A job started for ``run`` that is still running (a start not yet holding the run's lock)."""
        for job in self.jobs.values():
            if job.get("run_dir") == str(run) and job["proc"].poll() is None:
                return job
        return None

    def view(self, job_id: str) -> dict[str, Any]:
        job = self.jobs.get(job_id)
        if job is None:
            raise Refused(404, f"no job {job_id}")
        rc = job["proc"].poll()
        return {k: v for k, v in job.items() if k != "proc"} | {
            "running": rc is None, "returncode": rc, "tail": rv.tail(Path(job["log"]), 30)}


def create_app(root: str | os.PathLike, token: str | None, presets: str | os.PathLike | None = None, *,
               host: str = "127.0.0.1", allow_hosts: tuple[str, ...] | list[str] = ()) -> Any:
    """The app. ``token``: asked of every request (None: none, as ``--no-token``); ``host``: the
    address it is bound to; ``allow_hosts``: other names it answers to (a tunnel's, a proxy's)."""
    root = Path(root).expanduser().resolve()
    preset_dir = Path(presets).expanduser().resolve() if presets else None
    app = FastAPI(title="imglora", docs_url=None, redoc_url=None, openapi_url=None)
    launcher = Launcher(root)
    app.state.launcher = launcher
    secret = secrets.token_bytes(32)  # signs the XSRF cookies this server hands out
    extra_hosts = {host_name(h) for h in allow_hosts if h.strip()}
    allowed = {*LOCAL_HOSTS, host_name(host), *extra_hosts}
    wildcard = host in WILDCARD_HOSTS
    if wildcard:
        allowed.add(socket.gethostname().lower())

    def xsrf_value() -> str:
        nonce = secrets.token_urlsafe(18)
        return f"{nonce}.{hmac.new(secret, nonce.encode(), hashlib.sha256).hexdigest()[:32]}"

    def xsrf_valid(value: str) -> bool:
        nonce, _, sig = value.partition(".")
        want = hmac.new(secret, nonce.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]
        return _ascii_token(sig, want)

    def host_allowed(name: str) -> bool:
        return name in allowed or (wildcard and _is_ip(name))

    def secure(response: Any, path: str) -> Any:
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers.setdefault("Content-Security-Policy", FILES_CSP if path.startswith("/files/") else PAGE_CSP)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    def deny(status: int, message: str, path: str) -> Any:
        return secure(JSONResponse({"error": message}, status_code=status), path)

    def cross_site(request: Request) -> str | None:
        """Why a state-changing request does not come from the page itself, or None."""
        site = request.headers.get("sec-fetch-site")
        if site is not None and site not in ("same-origin", "none"):
            return (f"a {site} request (Sec-Fetch-Site) is refused: the UI takes actions only from its own page "
                    "(another site, or another port of this host, cannot start, stop or write anything)")
        origin = request.headers.get("origin")
        if origin is None:
            return None
        parts = urlsplit(origin)
        netloc, here = parts.netloc.lower(), request.headers.get("host", "").lower()
        if origin != "null" and parts.scheme in ("http", "https") and (
                netloc == here or host_name(netloc) in extra_hosts):
            return None
        return (f"Origin {origin!r} is not this server ({here}): cross-site requests are refused; use the UI's own "
                f"page (a proxy or tunnel under another name: start with --allow-host NAME)")

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        path = request.url.path
        launcher.reap()
        given_host = request.headers.get("host", "")
        if not host_allowed(host_name(given_host)):
            return deny(403, f"Host {given_host!r} is not a name this server answers to (a guard against DNS "
                             "rebinding): open it as http://127.0.0.1:PORT/, or, to reach it under that name (an SSH "
                             f"tunnel's or a proxy's), start it with --allow-host {host_name(given_host) or 'NAME'}",
                        path)
        by_header = False
        token_cookie, xsrf_cookie = cookie_names(given_host)
        if token:
            query = request.query_params.get("token")
            if query is not None:  # the printed link: swap the token for a cookie, then a clean URL
                if request.method != "GET" or not _ascii_token(query, token):
                    return deny(401, "wrong token in ?token=: open the URL `imglora ui` printed", path)
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                response = RedirectResponse(path + (f"?{urlencode(rest)}" if rest else ""), status_code=303)
                response.set_cookie(token_cookie, token, httponly=True, samesite="strict", path="/")
                response.set_cookie(xsrf_cookie, xsrf_value(), httponly=False, samesite="strict", path="/")
                return secure(response, path)
            auth = request.headers.get("authorization", "")
            by_header = auth[:7].lower() == "bearer " and _ascii_token(auth[7:].strip(), token)
            if not by_header and not _ascii_token(request.cookies.get(token_cookie, ""), token):
                return deny(401, "a token is needed: open the URL `imglora ui` printed (http://HOST:PORT/?token=...), "
                                 "or send Authorization: Bearer TOKEN", path)
        if request.method in STATE_CHANGING:
            why = cross_site(request)
            if why:
                return deny(403, why, path)
            ctype = request.headers.get("content-type")
            has_body = request.headers.get("content-length", "0") not in ("0", "") or \
                "transfer-encoding" in request.headers
            if (ctype or has_body) and (ctype or "").split(";")[0].strip().lower() != "application/json":
                return deny(415, f"Content-Type {ctype or '(none)'!r}: the UI's API takes JSON only "
                                 "(Content-Type: application/json)", path)
            length = request.headers.get("content-length", "0")
            if length.isdigit() and int(length) > MAX_BODY:
                return deny(413, f"the request body is {length} bytes; at most {MAX_BODY}", path)
            if not by_header:
                cookie, header = request.cookies.get(xsrf_cookie, ""), request.headers.get(XSRF_HEADER, "")
                if not (cookie and header and _ascii_token(header, cookie) and xsrf_valid(cookie)):
                    return deny(403, f"missing or wrong {XSRF_HEADER} header: reload the UI's page (its script "
                                     f"sends the {xsrf_cookie} cookie back in that header); a script sends "
                                     "Authorization: Bearer TOKEN instead", path)
        response = await call_next(request)  # (Refused is answered by the exception handler below)
        if not xsrf_valid(request.cookies.get(xsrf_cookie, "")):
            response.set_cookie(xsrf_cookie, xsrf_value(), httponly=False, samesite="strict", path="/")
        return secure(response, path)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Any:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    def run_dir(name: str) -> Path:
        for run in rv.find_runs(root):
            if run.name == name:
                return run
        raise Refused(404, f"no run folder named {_short(name)} under {root}")

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
        from ..runlock import process_matches

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
        from ..runlock import LOCK_NAME

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
                raise Refused(422, f"{key}: a NUL byte in {_short(value)}")
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
            raise Refused(422, f"offers: expected a list of NAME:RATE strings, got {_short(offers_in)}")
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
            out = links_out(base) if base is not None else []
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

    def links_out(base: Path, most: int = 100_000) -> list[Path]:
        """Entries under ``base`` (a folder inside the root) whose real path is outside the root."""
        out: list[Path] = []
        if not base.is_dir():
            return out
        seen = 0
        for top, dirs, files in os.walk(base):  # (symlinked folders are listed, not entered)
            for name in sorted(dirs + files):
                seen += 1
                entry = Path(top) / name
                if entry.is_symlink() and rv.inside_root(entry, root) is None:
                    out.append(entry)
            if seen > most:
                break
        return sorted(out)

    @app.put("/api/caption")
    async def put_caption(request: Request) -> Any:
        from .. import atomic

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


def check_token(token: str) -> None:
    from ..errors import ImgloraError

    if len(token) < 8 or not re.fullmatch(r"[A-Za-z0-9._~-]+", token):
        raise ImgloraError(f"--token {token!r}: a token is at least 8 characters of A-Z, a-z, 0-9 and . _ ~ - (it "
                           "goes into a URL and a header); or leave --token out and use the one printed")


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
