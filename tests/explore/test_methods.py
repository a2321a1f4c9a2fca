"""HTTP methods on the explorer's server: each path answers its own methods (the pages and ``/api/info`` GET and
HEAD, the other endpoints POST); any other method on an existing path is a 405 with ``Allow`` and a one-line JSON
error, an unknown path a 404 whatever the method, and the HTTP server's own errors are JSON too."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.explore.test_server import raw_request
from tformer.explore.server import ENDPOINTS

GET_PAGES = ["/", "/app.js", "/maps.js", "/circuits.js", "/style.css", "/api/info"]
POST_ENDPOINTS = [f"/api/{name}" for name in ENDPOINTS]


def send(server, method: str, path: str, body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
    """``method path`` on its own connection: the status, the headers (lower-case names) and the body."""
    conn = http.client.HTTPConnection(*server.server_address[:2], timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def json_error(headers: dict[str, str], body: bytes) -> str:
    """The one-line message of a JSON error reply."""
    assert headers["content-type"] == "application/json"
    out = json.loads(body)
    assert list(out) == ["error"] and "\n" not in out["error"]
    return out["error"]


@pytest.mark.parametrize("method", ["PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "FOO"])
@pytest.mark.parametrize("path", ["/api/analyze", "/api/info", "/"])
def test_another_method_on_an_existing_path_is_a_405_naming_the_allowed_ones(lm_server, method, path):
    status, headers, body = send(lm_server, method, path, b'{"prompt": "ab"}')
    allowed = "POST" if path == "/api/analyze" else "GET, HEAD"
    assert status == 405 and headers["allow"] == allowed
    use = allowed.replace(", ", " or ")
    assert json_error(headers, body) == f"{path!r} does not take {method}; use {use}"


@pytest.mark.parametrize("path", POST_ENDPOINTS)
def test_get_on_a_post_endpoint_is_a_405_naming_post(lm_server, path):
    status, headers, body = send(lm_server, "GET", path)
    assert status == 405 and headers["allow"] == "POST"
    assert json_error(headers, body) == f"{path!r} does not take GET; use POST"


def test_post_on_a_get_page_is_a_405_naming_get_and_head(lm_server):
    status, headers, body = send(lm_server, "POST", "/api/info", b"{}")
    assert status == 405 and headers["allow"] == "GET, HEAD"
    assert json_error(headers, body) == "'/api/info' does not take POST; use GET or HEAD"


@pytest.mark.parametrize("method", ["GET", "POST", "PUT", "DELETE"])
def test_an_unknown_path_is_a_404_whatever_the_method(lm_server, method):
    status, headers, body = send(lm_server, method, "/api/nope", b"{}")
    assert status == 404 and "allow" not in headers
    expected = "no such endpoint '/api/nope'; POST to" if method == "POST" else "no such page '/api/nope'"
    assert json_error(headers, body).startswith(expected)


@pytest.mark.parametrize("path", GET_PAGES)
def test_head_is_get_without_the_body(lm_server, path):
    status, headers, body = send(lm_server, "HEAD", path)
    get_status, get_headers, get_body = send(lm_server, "GET", path)
    assert status == get_status == 200 and body == b""
    assert headers["content-length"] == str(len(get_body))
    assert headers["content-type"] == get_headers["content-type"]


def test_head_on_a_post_endpoint_is_a_405_without_a_body(lm_server):
    status, headers, body = send(lm_server, "HEAD", "/api/analyze")
    assert status == 405 and headers["allow"] == "POST" and headers["content-type"] == "application/json"
    assert body == b"" and int(headers["content-length"]) > 0  # the length of the error GET would have read


def test_a_refused_body_closes_the_connection_and_the_server_goes_on(lm_server, lm_client):
    body = b'{"prompt": "ab"}'
    head = f"PUT /api/analyze HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    reply = raw_request(lm_server, head + body)  # returns once the server has closed the connection
    assert reply.startswith(b"HTTP/1.1 405") and b"\r\nConnection: close\r\n" in reply
    assert reply.count(b"HTTP/1.1") == 1  # the unread body was not taken for a second request
    status, out = lm_client.post("/api/analyze", {"prompt": "still here"})
    assert status == 200 and "".join(out["tokens"]) == "still here"


def test_the_http_servers_own_errors_are_json(lm_server):
    reply = raw_request(lm_server, b"GET / and more HTTP/1.1\r\nHost: x\r\n\r\n")  # four words: not a request line
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"\r\nContent-Type: application/json\r\n" in head
    assert json.loads(body) == {"error": "Bad request syntax ('GET / and more HTTP/1.1')"}
