"""The ``tformer explore`` server: the page's own files and a small JSON API, on the standard library's threading
HTTP server. Nothing is fetched from anywhere else; the page's Content-Security-Policy forbids it too.

API (``POST``, a JSON object in, a JSON object out; a bad request gets a 4xx and ``{"error": "one line"}``):

* ``/api/info`` (``GET``): the model: name, kind (``lm`` or ``seq2seq``), attention kinds, layers, heads, ..., the
  dtype it computes in, and ``prompt``: a first prompt that suits it (Python for a model trained on code, English
  for a pretrained one; :func:`tformer.explore.analysis.default_prompt`)
* ``/api/analyze`` ``{"prompt", "temperature"=1, "top_k"=null, "top_p"=null, "target"=""}``: ``tokens`` (each
  token's text), ``ids``, ``next`` (the top of the next-token distribution: ``id``, ``token``, ``prob`` after the
  filters and renormalization, ``raw`` before them, ``kept``) and ``layers`` (per attention kind, per layer, each
  head's mean entropy). ``target`` is a seq2seq model's decoder prefix.
* ``/api/attention`` ``{"prompt", "layer", "kind"="self", "scale_factor"=1, "mask"="before", "target"=""}``: that
  layer's weights ``(heads, T, S)`` as nested lists, the query and key tokens, and per head the entropy, the
  softmax Jacobian's norm and the range of row sums. ``scale_factor`` multiplies ``1/sqrt(d_k)``;
  ``mask`` puts the causal mask ``before`` the softmax (the model's way), ``after`` it (rows stop summing to 1),
  or ``none``.
* ``/api/sample`` ``{"prompt", "seed", "temperature", "top_k", "top_p"}``: one token drawn as
  ``tformer.generate(..., seed=seed)`` draws its first, and the prompt with it appended.
* ``/api/positions`` ``{"prompt", "layer", "kind"="self"}``: scores against the offset ``n - m`` (RoPE: the
  layer's real projections; sinusoidal: the table).
* ``/api/lens`` ``{"prompt", "position"=-1, "k"=5}``: the logit lens at ``position`` (negative counts from the end):
  ``rows`` (``embed``, then ``L0`` .. ``L{n-1}``, the residual stream leaving each block through the final norm and
  the output head), each ``{"label", "top": [{"id", "token", "prob"}] (k), "final_prob"}`` (``final_prob``: the
  row's probability of ``final``, the model's own top token); ``position`` (as an index), ``token``, ``tokens``.
  The last row is the model's own distribution. Language models only.
* ``/api/ablate`` ``{"prompt", "heads": [[layer, head], ...], "temperature"=1, "top_k"=null, "top_p"=null}``: the
  next-token distribution with those heads zero-ablated beside the model's own: ``next`` as ``/api/analyze``'s
  (``prob``, ``raw``, ``kept``: ablated) with ``original`` and ``original_raw`` (not ablated), the 20 tokens most
  probable in either; ``heads`` (distinct), ``total_variation`` (between the two raw distributions). ``heads``
  ``[]`` is the model itself. Language models only.
* ``/api/patch`` ``{"clean", "corrupted", "correct"=null, "wrong"=null}``: activation patching of the residual
  stream entering each block, metric the logit difference ``correct - wrong`` at the last position: ``patched``
  ``(L, T)`` (the corrupted run with the clean stream put back at one layer and position), ``restored`` ``(L, T)``
  (``(patched - corrupted_diff) / (clean_diff - corrupted_diff)``; ``null`` when the two runs give the same
  difference), ``clean_diff``, ``corrupted_diff``, ``correct`` and ``wrong`` (``{"id", "token"}``), ``layers``,
  ``clean_tokens``, ``corrupted_tokens``. The prompts must have the same token length; ``correct`` and ``wrong`` are
  one token each (its text or id), by default the clean run's top token and the corrupted run's; layers x tokens
  at most :data:`tformer.explore.probes.MAX_PATCH_FORWARDS` (one forward each). Language models only.

Methods: the page's files (``/``, ``/app.js``, ``/maps.js``, ``/circuits.js``, ``/style.css``) and ``/api/info``
answer ``GET`` and ``HEAD`` (the same status and headers as ``GET``, no body: HTTP requires a server that answers
``GET`` to answer ``HEAD``); the other endpoints answer ``POST``. Any other method, on a path that exists, is a
``405`` with an ``Allow`` header naming the path's methods (``GET /api/analyze`` too, and ``POST /api/info``); a
path that does not exist is a ``404`` whatever the method. Every error, these and the HTTP server's own (a malformed
request line, a URI or headers over its limits), is JSON: ``{"error": "one line"}``.

Limits: a body over :data:`MAX_BODY` bytes is refused from its ``Content-Length`` before it is read; a client that
stops sending is dropped after :data:`READ_TIMEOUT` seconds; one forward pass runs at a time (a lock), requests in
any number of threads.
"""

from __future__ import annotations

import json
import math
import sys
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from tformer.explore import analysis, probes
from tformer.explore.analysis import MASK_MODES, ExploreError, Explorer

MAX_BODY = 64 * 1024
MAX_PROMPT_CHARS = 20_000
READ_TIMEOUT = 10.0
STATIC = {
    "/": "index.html",
    "/app.js": "app.js",
    "/maps.js": "maps.js",
    "/circuits.js": "circuits.js",
    "/style.css": "style.css",
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8", ".css": "text/css"}
CSP = "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; script-src 'self'; connect-src 'self'"

REQUIRED = object()  # the default of a field that must be given
# request fields: name -> (types accepted, default); "kind" "" is the model's first attention kind
_SAMPLING = {
    "temperature": ((int, float), 1.0),
    "top_k": ((int, type(None)), None),
    "top_p": ((int, float, type(None)), None),
}
_LAYER = {"layer": ((int,), REQUIRED), "kind": ((str,), "")}
FIELDS: dict[str, dict[str, tuple[tuple[type, ...], Any]]] = {
    "analyze": {"prompt": ((str,), REQUIRED), **_SAMPLING, "target": ((str,), "")},
    "attention": {
        "prompt": ((str,), REQUIRED),
        **_LAYER,
        "scale_factor": ((int, float), 1.0),
        "mask": ((str,), "before"),
        "target": ((str,), ""),
    },
    "sample": {"prompt": ((str,), REQUIRED), "seed": ((int,), 0), **_SAMPLING, "target": ((str,), "")},
    "positions": {"prompt": ((str,), REQUIRED), **_LAYER, "target": ((str,), "")},
    "lens": {"prompt": ((str,), REQUIRED), "position": ((int,), -1), "k": ((int,), 5)},
    "ablate": {"prompt": ((str,), REQUIRED), "heads": ((list,), REQUIRED), **_SAMPLING},
    "patch": {
        "clean": ((str,), REQUIRED),
        "corrupted": ((str,), REQUIRED),
        "correct": ((str, int, type(None)), None),
        "wrong": ((str, int, type(None)), None),
    },
}
TEXTS = ("prompt", "clean", "corrupted")  # the fields that are text to encode


class BadRequest(ValueError):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST) -> None:
        super().__init__(message)
        self.status = status


def parse(endpoint: str, body: bytes, ex: Explorer) -> dict[str, Any]:
    """The request's fields with defaults filled in, or :class:`BadRequest` naming the bad one."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BadRequest(f"the body is not JSON: {err}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object; got {type(data).__name__}")
    spec = FIELDS[endpoint]
    unknown = sorted(set(data) - set(spec))
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(unknown)}; {endpoint} takes {', '.join(spec)}")
    out = {}
    for name, (types, default) in spec.items():
        if name not in data:
            if default is REQUIRED:
                raise BadRequest(f"missing field {name!r}")
            out[name] = default
            continue
        value = data[name]
        if isinstance(value, bool) or not isinstance(value, types):
            allowed = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise BadRequest(f"{name} must be {allowed}; got {json.dumps(value)[:40]}")
        out[name] = value
    if out.get("kind") == "":
        out["kind"] = analysis.KINDS[ex.kind][0]
    _check_values(out, ex)
    return out


def _check_values(req: dict[str, Any], ex: Explorer) -> None:
    for name in TEXTS:
        if name in req and len(req[name]) > MAX_PROMPT_CHARS:
            raise BadRequest(f"the {name} is {len(req[name])} characters; at most {MAX_PROMPT_CHARS}")
    if "temperature" in req and not (math.isfinite(req["temperature"]) and req["temperature"] > 0):
        raise BadRequest(f"temperature must be a finite number > 0; got {req['temperature']}")
    if req.get("top_k") is not None and req["top_k"] < 1:
        raise BadRequest(f"top_k must be >= 1 or null; got {req['top_k']}")
    if req.get("top_p") is not None and not 0 < req["top_p"] <= 1:
        raise BadRequest(f"top_p must be in (0, 1] or null; got {req['top_p']}")
    if "mask" in req and req["mask"] not in MASK_MODES:
        raise BadRequest(f"mask must be one of {', '.join(MASK_MODES)}; got {req['mask']!r}")
    if "scale_factor" in req and not (math.isfinite(req["scale_factor"]) and req["scale_factor"] >= 0):
        raise BadRequest(f"scale_factor must be a finite number >= 0; got {req['scale_factor']}")
    if "seed" in req and not 0 <= req["seed"] < 2**63:
        raise BadRequest(f"seed must be in [0, 2**63); got {req['seed']}")
    if "kind" in req:
        kinds = analysis.KINDS[ex.kind]
        if req["kind"] not in kinds:
            raise BadRequest(f"kind must be one of {', '.join(kinds)} for this model; got {req['kind']!r}")
        layers = ex.num_layers[req["kind"]]
        if "layer" in req and not 0 <= req["layer"] < layers:
            raise BadRequest(f"layer must be in [0, {layers}) for {req['kind']}; got {req['layer']}")


def _tokens(ex: Explorer, ids: list[int]) -> list[str]:
    return [analysis.piece(ex.tokenizer, i) for i in ids]


def api_analyze(ex: Explorer, req: dict[str, Any]) -> dict[str, Any]:
    fwd = analysis.forward(ex, req["prompt"], req["target"])
    layers = {}
    for kind in analysis.KINDS[ex.kind]:
        layers[kind] = []
        for mha in ex.layers(kind):
            probs, _ = analysis.attention_map(mha, fwd.inputs[mha])
            layers[kind].append({"entropy": analysis.head_summaries(probs)["entropy"]})
    return {
        "tokens": _tokens(ex, fwd.ids),
        "ids": fwd.ids,
        "target_tokens": _tokens(ex, fwd.target_ids),
        "next": analysis.next_tokens(ex, fwd.logits, req["temperature"], req["top_k"], req["top_p"]),
        "layers": layers,
    }


def api_attention(ex: Explorer, req: dict[str, Any]) -> dict[str, Any]:
    fwd = analysis.forward(ex, req["prompt"], req["target"])
    mha = ex.layers(req["kind"])[req["layer"]]
    probs, _ = analysis.attention_map(mha, fwd.inputs[mha], scale_factor=req["scale_factor"], mask=req["mask"])
    source = fwd.ids if ex.kind == "lm" or req["kind"] == "encoder" else fwd.target_ids
    keys = fwd.ids if ex.kind == "lm" or req["kind"] in ("encoder", "cross") else fwd.target_ids
    return {
        "layer": req["layer"],
        "kind": req["kind"],
        "queries": _tokens(ex, source),
        "keys": _tokens(ex, keys),
        "causal": fwd.inputs[mha][3],
        "scale": req["scale_factor"] / math.sqrt(mha.head_dim),
        "weights": probs.float().tolist(),
        **analysis.head_summaries(probs),
    }


def api_sample(ex: Explorer, req: dict[str, Any]) -> dict[str, Any]:
    fwd = analysis.forward(ex, req["prompt"], req["target"])
    token = analysis.draw(ex, fwd.logits, req["seed"], req["temperature"], req["top_k"], req["top_p"])
    text = analysis.piece(ex.tokenizer, token)
    if ex.kind == "lm":
        return {"id": token, "token": text, "prompt": ex.tokenizer.decode([*fwd.ids, token])}
    return {"id": token, "token": text, "target": ex.tokenizer.decode([*fwd.target_ids[1:], token])}


def api_positions(ex: Explorer, req: dict[str, Any]) -> dict[str, Any]:
    fwd = analysis.forward(ex, req["prompt"], req["target"])
    return analysis.position_scores(ex, fwd, req["layer"], req["kind"])


def api_lens(ex: Explorer, req: dict[str, Any]) -> dict[str, Any]:
    return probes.lens(ex, req["prompt"], req["position"], req["k"])


def api_ablate(ex: Explorer, req: dict[str, Any]) -> dict[str, Any]:
    return probes.ablated(ex, req["prompt"], req["heads"], req["temperature"], req["top_k"], req["top_p"])


def api_patch(ex: Explorer, req: dict[str, Any]) -> dict[str, Any]:
    return probes.patch(ex, req["clean"], req["corrupted"], req["correct"], req["wrong"])


ENDPOINTS = {
    "analyze": api_analyze,
    "attention": api_attention,
    "sample": api_sample,
    "positions": api_positions,
    "lens": api_lens,
    "ablate": api_ablate,
    "patch": api_patch,
}
PAGES = ("/api/info", *STATIC)  # what GET (and HEAD) serves


def allowed_methods(path: str) -> tuple[str, ...]:
    """The methods the resource at ``path`` answers (its ``Allow`` header); ``()`` when there is no such resource."""
    if path in PAGES:
        return ("GET", "HEAD")
    if path.startswith("/api/") and path.removeprefix("/api/") in ENDPOINTS:
        return ("POST",)
    return ()


class Handler(BaseHTTPRequestHandler):
    """One request. ``self.server.explorer`` is the model; the server's threads share it."""

    server_version = "tformer-explore"
    timeout = READ_TIMEOUT  # a client that stops sending mid-request is dropped, its thread freed
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)

    def _send(self, status: HTTPStatus, body: bytes, content_type: str, allow: tuple[str, ...] = ()) -> None:
        """The response; for ``HEAD`` its status and headers alone (``Content-Length`` still the body's)."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Security-Policy", CSP)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Cache-Control", "no-store")
            if allow:
                self.send_header("Allow", ", ".join(allow))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except (TimeoutError, BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left; nothing to tell it

    def _json(self, status: HTTPStatus, data: dict[str, Any], allow: tuple[str, ...] = ()) -> None:
        self._send(status, json.dumps(data, allow_nan=False).encode(), "application/json", allow)

    def _error(self, status: HTTPStatus, message: str, allow: tuple[str, ...] = ()) -> None:
        self._json(status, {"error": message.splitlines()[0] if message else status.phrase}, allow)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The base class's own errors (a malformed request line, a URI or headers over its limits) as JSON too,
        not its HTML page; the connection is closed after them, as the base class does."""
        status = HTTPStatus(code)
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        self._error(status, message or status.phrase)

    def parse_request(self) -> bool:
        """The base class's parsing, then the method and path: ``False`` (answered here) unless the path exists
        and takes the method (404: no such path; 405 with ``Allow``: not that method), so that a method without a
        ``do_`` handler (PUT, DELETE, ...) is a 405, not the base class's 501."""
        if not super().parse_request():
            return False
        path = urlsplit(self.path).path
        allowed = allowed_methods(path)
        if self.command in allowed:
            return True
        if self.command not in ("GET", "HEAD"):
            self.close_connection = True  # its body, if any, is left unread
        if not allowed and self.command == "POST":
            self._error(HTTPStatus.NOT_FOUND, f"no such endpoint {path[:80]!r}; POST to /api/{{{','.join(ENDPOINTS)}}}")
        elif not allowed:  # /../, absolute paths and anything else: only the page's own files and the API exist here
            self._error(HTTPStatus.NOT_FOUND, f"no such page {path[:80]!r}")
        else:
            use = " or ".join(allowed)
            self._error(
                HTTPStatus.METHOD_NOT_ALLOWED, f"{path[:80]!r} does not take {self.command[:20]}; use {use}", allowed
            )
        return False

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        if path == "/api/info":
            return self._json(HTTPStatus.OK, self.server.explorer.info())
        name = STATIC[path]  # parse_request let through only the pages
        body = resources.files("tformer.explore").joinpath("static", name).read_bytes()
        self._send(HTTPStatus.OK, body, TYPES[name[name.rindex(".") :]])

    do_HEAD = do_GET  # the same status and headers; _send leaves out the body

    def do_POST(self) -> None:
        endpoint = urlsplit(self.path).path.removeprefix("/api/")  # parse_request let through only the endpoints
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self.close_connection = True
            return self._error(HTTPStatus.LENGTH_REQUIRED, "send a Content-Length header with the JSON body")
        if int(length) > MAX_BODY:  # refused before reading it
            self.close_connection = True
            return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"the body is {length} bytes; at most {MAX_BODY}")
        try:
            body = self.rfile.read(int(length))
        except (TimeoutError, ConnectionResetError):
            self.close_connection = True
            return
        if len(body) < int(length):  # the client closed the connection mid-body
            self.close_connection = True
            return
        ex = self.server.explorer
        try:
            req = parse(endpoint, body, ex)
            result = ENDPOINTS[endpoint](ex, req)
        except BadRequest as err:
            return self._error(err.status, str(err))
        except ExploreError as err:
            return self._error(HTTPStatus.BAD_REQUEST, str(err))
        except Exception as err:  # a bug must not stop the server: the client gets a 500, the server keeps serving
            print(f"tformer explore: internal error on {endpoint}: {type(err).__name__}: {err}", file=sys.stderr)
            return self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {type(err).__name__}: {err}")
        self._json(HTTPStatus.OK, result)


class ExploreServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, explorer: Explorer, host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> None:
        self.explorer, self.verbose = explorer, verbose
        super().__init__((host, port), Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/"


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
