"""The explorer's server under load and abuse: 50 concurrent requests, a client that drops mid-request, bodies over
the cap, paths outside the page's files, the loopback default, and the CLI around it."""

from __future__ import annotations

import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import pytest

from tformer.cli import main
from tformer.explore.server import CSP, MAX_BODY, STATIC, ExploreServer, is_loopback


def test_fifty_concurrent_requests_are_all_answered_correctly(lm_client):
    prompts = [f"the {'ab'[i % 2]}{'cde'[i % 3]} fox {i % 5}" for i in range(50)]
    prompts = [p.replace(str(i % 5), "xyz"[i % 3]) for i, p in enumerate(prompts)]  # the tokenizer has no digits
    expected = {p: lm_client.post("/api/analyze", {"prompt": p})[1] for p in set(prompts)}

    def ask(i: int):
        if i % 2:
            return i, lm_client.post("/api/analyze", {"prompt": prompts[i]})
        return i, lm_client.post("/api/attention", {"prompt": prompts[i], "layer": i % 2})

    with ThreadPoolExecutor(max_workers=16) as pool:
        results = list(pool.map(ask, range(50)))
    assert len(results) == 50
    for i, (status, out) in results:
        assert status == 200
        if i % 2:
            assert out == expected[prompts[i]]  # the same answer as alone: no crossed requests
        else:
            assert len(out["weights"]) == 4 and len(out["queries"]) == len(prompts[i])


def raw_request(server: ExploreServer, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(server.server_address[:2], timeout=10) as sock:
        sock.sendall(data)
        if not read:
            return b""
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_the_server_keeps_serving_after_a_client_drops_mid_request(lm_server, lm_client):
    head = b"POST /api/analyze HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
    for _ in range(3):
        raw_request(lm_server, head + b'{"prompt": "ab', read=False)  # 14 of 500 bytes, then gone
        raw_request(lm_server, b"POST /api/analyze HTTP/1.1\r\nHost: x\r\nContent-Le", read=False)  # mid-header
    status, out = lm_client.post("/api/analyze", {"prompt": "still here"})
    assert status == 200 and "".join(out["tokens"]) == "still here"


def test_a_body_over_the_cap_is_refused_before_it_is_read(lm_server):
    head = f"POST /api/analyze HTTP/1.1\r\nHost: x\r\nContent-Length: {100 * MAX_BODY}\r\n\r\n".encode()
    start = time.monotonic()
    reply = raw_request(lm_server, head)  # no body sent at all: the answer comes from the header alone
    assert reply.startswith(b"HTTP/1.1 413") and b"at most 65536" in reply
    assert time.monotonic() - start < 5  # answered, not waiting for the 6.4 MB (the read timeout is 10 s)


def test_missing_content_length_and_unknown_endpoints(lm_server, lm_client):
    reply = raw_request(lm_server, b"POST /api/analyze HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 411")
    status, out = lm_client.post("/api/shell", {"prompt": "x"})
    assert status == 404 and "no such endpoint" in out["error"]


@pytest.mark.parametrize(
    "path",
    [
        "/../../etc/passwd",
        "/%2e%2e/%2e%2e/etc/passwd",
        "/etc/passwd",
        "/static/../server.py",
        "//etc/passwd",
        "/app.js/../../analysis.py",
        "http://example.com/index.html",
    ],
)
def test_paths_outside_the_pages_own_files_are_refused(lm_server, path):
    reply = raw_request(lm_server, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    assert reply.startswith(b"HTTP/1.1 404") and b"root:" not in reply and b"import" not in reply


def test_the_page_and_its_files_are_served_with_a_strict_policy(lm_client, lm_server):
    for path, kind in [("/", b"<!doctype html>"), ("/app.js", b"use strict"), ("/style.css", b"body")]:
        status, body = lm_client.request("GET", path)
        assert status == 200 and kind in body
    for path in ("/maps.js", "/circuits.js"):
        assert lm_client.request("GET", path) == (
            200,
            resources.files("tformer.explore").joinpath("static", path[1:]).read_bytes(),
        )
    reply = raw_request(lm_server, b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert f"Content-Security-Policy: {CSP}".encode() in reply
    html = lm_client.request("GET", "/")[1].decode()
    assert "http://" not in html and "https://" not in html  # nothing from anywhere else


def test_every_static_file_is_served_and_the_page_loads_every_script():
    files = {p.name for p in resources.files("tformer.explore").joinpath("static").iterdir() if p.name[0] != "."}
    assert files == set(STATIC.values())  # each file the package ships (package-data explore/static/*) is served
    html = resources.files("tformer.explore").joinpath("static", "index.html").read_text()
    scripts = re.findall(r'<script src="(/[\w.]+)"></script>', html)
    assert sorted(scripts) == sorted(p for p in STATIC if p.endswith(".js")) and scripts[-1] == "/app.js"  # main last


def test_default_bind_is_loopback(lm_checkpoint):
    from tformer.explore.analysis import open_model

    server = ExploreServer(open_model(lm_checkpoint))
    try:
        assert server.server_address[0] == "127.0.0.1" and server.url.startswith("http://127.0.0.1:")
    finally:
        server.server_close()
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")


def run_cli_briefly(monkeypatch, args: list[str]) -> int:
    """``tformer explore ...`` with serve_forever replaced by an immediate Ctrl-C."""

    def interrupted(self, poll_interval=0.5):
        raise KeyboardInterrupt

    monkeypatch.setattr(ExploreServer, "serve_forever", interrupted)
    return main(["explore", *args])


def test_cli_prints_the_url_and_warns_on_another_host(lm_checkpoint, monkeypatch, capsys):
    assert run_cli_briefly(monkeypatch, ["--checkpoint", str(lm_checkpoint), "--port", "0"]) == 0
    out, err = capsys.readouterr()
    assert "at http://127.0.0.1:" in out and "warning" not in err
    assert run_cli_briefly(monkeypatch, ["--checkpoint", str(lm_checkpoint), "--port", "0", "--host", "0.0.0.0"]) == 0
    out, err = capsys.readouterr()
    assert "warning: serving on 0.0.0.0, not loopback" in err


def test_cli_on_a_damaged_newest_checkpoint_names_the_good_older_one_as_sample_does(
    peaky, tmp_path, monkeypatch, capsys
):
    from tformer import DecoderLM, TransformerConfig
    from tformer.explore.analysis import open_model
    from tformer.tokenizers import CharTokenizer
    from tformer.training.checkpoint import WEIGHTS, CheckpointError, save_checkpoint

    tok = CharTokenizer("abc ")
    model = peaky(DecoderLM(TransformerConfig.tiny(vocab_size=tok.vocab_size)))
    for step in (10, 20):
        save_checkpoint(tmp_path, model=model, tokenizer=tok, kind="lm", step=step, train_config={}, keep=2)
    root = tmp_path / "checkpoints"
    weights = root / "step-000020" / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:100])
    hint = f"the newest checkpoint {root / 'step-000020'} is damaged ("
    good = f"delete it, or pass --checkpoint {root / 'step-000010'}"
    with pytest.raises(CheckpointError) as caught:
        open_model(tmp_path)
    assert str(caught.value).startswith(hint) and str(caught.value).endswith(good)

    assert run_cli_briefly(monkeypatch, ["--checkpoint", str(tmp_path), "--port", "0"]) == 2
    explore_err = capsys.readouterr().err
    assert main(["sample", "--checkpoint", str(tmp_path), "--prompt", "ab"]) == 2
    sample_err = capsys.readouterr().err
    assert explore_err.startswith(f"tformer explore: error: {hint}") and explore_err.rstrip().endswith(good)
    assert explore_err.removeprefix("tformer explore") == sample_err.removeprefix("tformer sample")  # one hint
    assert run_cli_briefly(monkeypatch, ["--checkpoint", str(root / "step-000010"), "--port", "0"]) == 0


def test_cli_errors_are_one_line(lm_checkpoint, tmp_path, monkeypatch, capsys):
    assert run_cli_briefly(monkeypatch, ["--checkpoint", str(tmp_path / "none")]) == 2
    assert "tformer explore: error:" in capsys.readouterr().err
    assert run_cli_briefly(monkeypatch, ["--checkpoint", str(lm_checkpoint), "--port", "70000"]) == 2
    assert "--port must be in [0, 65535]" in capsys.readouterr().err
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        port = str(busy.getsockname()[1])
        assert run_cli_briefly(monkeypatch, ["--checkpoint", str(lm_checkpoint), "--port", port]) == 2
        assert "cannot serve on 127.0.0.1" in capsys.readouterr().err
    finally:
        busy.close()


def test_an_internal_error_is_a_500_and_the_server_goes_on(lm_client, monkeypatch):
    from tformer.explore import server

    def broken(ex, req):
        raise RuntimeError("boom")

    monkeypatch.setitem(server.ENDPOINTS, "positions", broken)
    status, out = lm_client.post("/api/positions", {"prompt": "ab", "layer": 0})
    assert status == 500 and "boom" in out["error"]
    monkeypatch.undo()
    assert lm_client.post("/api/positions", {"prompt": "ab", "layer": 0})[0] == 200


def test_cli_quantize_int8_serves_the_quantized_model(lm_checkpoint, monkeypatch, capsys):
    from tformer.engine.quantization import Int8Linear

    served = []
    monkeypatch.setattr(ExploreServer, "server_close", lambda self: served.append(self.explorer))
    args = ["--checkpoint", str(lm_checkpoint), "--port", "0", "--quantize", "int8", "--dtype", "bfloat16"]
    assert run_cli_briefly(monkeypatch, args) == 0
    assert "(int8) at http://127.0.0.1:" in capsys.readouterr().out
    assert any(isinstance(m, Int8Linear) for m in served[0].model.modules())
    assert served[0].info()["dtype"] == "bfloat16"  # the page names what the model computes in
