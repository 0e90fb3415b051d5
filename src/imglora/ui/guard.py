"""The checks every request to ``imglora ui`` passes before an endpoint sees it, and the helpers
endpoints use to refuse bad input with a clear 4xx (``Refused``): the token (a printed URL swapped for
an HTTP-only cookie), the Host allowlist against DNS rebinding, Origin / Sec-Fetch-Site and a
double-submit XSRF cookie on every state-changing request, JSON-only bodies with a size limit, the
page's and the served files' security headers, and paths kept inside the UI's root."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

from fastapi import Request
from fastapi.responses import JSONResponse, RedirectResponse

from .run_folders import inside_root

LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")

# Cookie names end with the port the browser sees ("imglora_token_7860"): a browser keeps one cookie jar
# for every port of a host, so two UIs on one machine would otherwise log each other out.
TOKEN_COOKIE = "imglora_token"
XSRF_COOKIE = "imglora_xsrf"  # readable by the page's script, which sends it back in XSRF_HEADER
XSRF_HEADER = "x-xsrf-token"
STATE_CHANGING = ("POST", "PUT", "PATCH", "DELETE")
MAX_BODY = 1 << 20  # bytes of a request body
MAX_NAME = 255  # bytes of one path component (the file systems' limit)
MAX_PATH = 4096

PAGE_CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
            "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
FILES_CSP = "sandbox; default-src 'none'; img-src 'self'; style-src 'unsafe-inline'"


class Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def short(value: Any, n: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "...'"


def check_path_text(relative: str, what: str = "path") -> None:
    """Refuse (400) a path no file system takes: a NUL byte, a component over 255 bytes, over 4096 in all."""
    if "\x00" in relative:
        raise Refused(400, f"{short(relative)}: a NUL byte in the {what}; give a plain path inside the UI's root")
    if len(relative.encode("utf-8", "surrogatepass")) > MAX_PATH:
        raise Refused(400, f"{short(relative)}: a {what} of {len(relative)} characters; at most {MAX_PATH} bytes")
    for part in re.split(r"[/\\]", relative):
        if len(part.encode("utf-8", "surrogatepass")) > MAX_NAME:
            raise Refused(400, f"{short(part)}: a name of {len(part.encode('utf-8', 'surrogatepass'))} bytes in the "
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


def clean_overrides(values: Any, key: str = "overrides") -> list[str]:
    """The form's ``KEY=VALUE`` lines, each one line (a line break would end the value early, and what
    follows it would be lost or read as another key): else 422 naming the key."""
    if values is None:
        return []
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise Refused(422, f"{key}: expected a list of KEY=VALUE strings, got {short(values)}")
    for value in values:
        name = value.split("=", 1)[0].strip() or value
        if "\n" in value or "\r" in value or "\x00" in value:
            what = "a NUL byte" if "\x00" in value else "a line break"
            raise Refused(422, f"{name}: {what} in its value ({short(value)}); a value must be one line (a TOML "
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
        raise Refused(422, f"{key}: expected {names}, got {short(value)}")
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


def links_out(base: Path, root: Path, most: int = 100_000) -> list[Path]:
    """Entries under ``base`` (a folder inside the root) whose real path is outside the root."""
    out: list[Path] = []
    if not base.is_dir():
        return out
    seen = 0
    for top, dirs, files in os.walk(base):  # (symlinked folders are listed, not entered)
        for name in sorted(dirs + files):
            seen += 1
            entry = Path(top) / name
            if entry.is_symlink() and inside_root(entry, root) is None:
                out.append(entry)
        if seen > most:
            break
    return sorted(out)


def check_token(token: str) -> None:
    from ..errors import ImgloraError

    if len(token) < 8 or not re.fullmatch(r"[A-Za-z0-9._~-]+", token):
        raise ImgloraError(f"--token {token!r}: a token is at least 8 characters of A-Z, a-z, 0-9 and . _ ~ - (it "
                           "goes into a URL and a header); or leave --token out and use the one printed")


class Guard:
    """The middleware: ``token`` asked of every request (None: none, as ``--no-token``), ``host`` the
    address bound, ``allow_hosts`` other names answered to (a tunnel's, a proxy's); ``before`` runs
    first on every request (the launcher's reaping)."""

    def __init__(self, token: str | None, host: str, allow_hosts: tuple[str, ...] | list[str] = (),
                 before: Any = None):
        self.token, self.before = token, before
        self.secret = secrets.token_bytes(32)  # signs the XSRF cookies this server hands out
        self.extra_hosts = {host_name(h) for h in allow_hosts if h.strip()}
        self.allowed = {*LOCAL_HOSTS, host_name(host), *self.extra_hosts}
        self.wildcard = host in WILDCARD_HOSTS
        if self.wildcard:
            self.allowed.add(socket.gethostname().lower())

    def xsrf_value(self) -> str:
        nonce = secrets.token_urlsafe(18)
        return f"{nonce}.{hmac.new(self.secret, nonce.encode(), hashlib.sha256).hexdigest()[:32]}"

    def xsrf_valid(self, value: str) -> bool:
        nonce, _, sig = value.partition(".")
        want = hmac.new(self.secret, nonce.encode("utf-8", "surrogatepass"), hashlib.sha256).hexdigest()[:32]
        return _ascii_token(sig, want)

    def host_allowed(self, name: str) -> bool:
        return name in self.allowed or (self.wildcard and _is_ip(name))

    @staticmethod
    def secure(response: Any, path: str) -> Any:
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Referrer-Policy"] = "no-referrer"
        response.headers["X-Frame-Options"] = "DENY"
        response.headers.setdefault("Content-Security-Policy", FILES_CSP if path.startswith("/files/") else PAGE_CSP)
        response.headers.setdefault("Cache-Control", "no-store")
        return response

    def deny(self, status: int, message: str, path: str) -> Any:
        return self.secure(JSONResponse({"error": message}, status_code=status), path)

    def cross_site(self, request: Request) -> str | None:
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
                netloc == here or host_name(netloc) in self.extra_hosts):
            return None
        return (f"Origin {origin!r} is not this server ({here}): cross-site requests are refused; use the UI's own "
                f"page (a proxy or tunnel under another name: start with --allow-host NAME)")

    async def __call__(self, request: Request, call_next: Any) -> Any:
        path = request.url.path
        if self.before:
            self.before()
        given_host = request.headers.get("host", "")
        if not self.host_allowed(host_name(given_host)):
            return self.deny(403, f"Host {given_host!r} is not a name this server answers to (a guard against DNS "
                             "rebinding): open it as http://127.0.0.1:PORT/, or, to reach it under that name (an SSH "
                             f"tunnel's or a proxy's), start it with --allow-host {host_name(given_host) or 'NAME'}",
                        path)
        by_header = False
        token_cookie, xsrf_cookie = cookie_names(given_host)
        if self.token:
            query = request.query_params.get("token")
            if query is not None:  # the printed link: swap the token for a cookie, then a clean URL
                if request.method != "GET" or not _ascii_token(query, self.token):
                    return self.deny(401, "wrong token in ?token=: open the URL `imglora ui` printed", path)
                rest = [(k, v) for k, v in request.query_params.multi_items() if k != "token"]
                response = RedirectResponse(path + (f"?{urlencode(rest)}" if rest else ""), status_code=303)
                response.set_cookie(token_cookie, self.token, httponly=True, samesite="strict", path="/")
                response.set_cookie(xsrf_cookie, self.xsrf_value(), httponly=False, samesite="strict", path="/")
                return self.secure(response, path)
            auth = request.headers.get("authorization", "")
            by_header = auth[:7].lower() == "bearer " and _ascii_token(auth[7:].strip(), self.token)
            if not by_header and not _ascii_token(request.cookies.get(token_cookie, ""), self.token):
                return self.deny(401, "a token is needed: open the URL `imglora ui` printed (http://HOST:PORT/?token=...), "
                                 "or send Authorization: Bearer TOKEN", path)
        if request.method in STATE_CHANGING:
            why = self.cross_site(request)
            if why:
                return self.deny(403, why, path)
            ctype = request.headers.get("content-type")
            has_body = request.headers.get("content-length", "0") not in ("0", "") or \
                "transfer-encoding" in request.headers
            if (ctype or has_body) and (ctype or "").split(";")[0].strip().lower() != "application/json":
                return self.deny(415, f"Content-Type {ctype or '(none)'!r}: the UI's API takes JSON only "
                                 "(Content-Type: application/json)", path)
            length = request.headers.get("content-length", "0")
            if length.isdigit() and int(length) > MAX_BODY:
                return self.deny(413, f"the request body is {length} bytes; at most {MAX_BODY}", path)
            if not by_header:
                cookie, header = request.cookies.get(xsrf_cookie, ""), request.headers.get(XSRF_HEADER, "")
                if not (cookie and header and _ascii_token(header, cookie) and self.xsrf_valid(cookie)):
                    return self.deny(403, f"missing or wrong {XSRF_HEADER} header: reload the UI's page (its script "
                                     f"sends the {xsrf_cookie} cookie back in that header); a script sends "
                                     "Authorization: Bearer TOKEN instead", path)
        response = await call_next(request)  # (Refused is answered by the exception handler below)
        if not self.xsrf_valid(request.cookies.get(xsrf_cookie, "")):
            response.set_cookie(xsrf_cookie, self.xsrf_value(), httponly=False, samesite="strict", path="/")
        return self.secure(response, path)
