"""Tiny models behind a live explorer server (a thread on a free loopback port), for the API and browser tests."""

from __future__ import annotations

import http.client
import json
import threading

import pytest
import torch

from tformer import DecoderLM, TransformerConfig
from tformer.explore.analysis import open_model
from tformer.explore.server import ExploreServer
from tformer.tokenizers import SEQ2SEQ_SPECIALS, ByteTokenizer, CharTokenizer
from tformer.training.checkpoint import save_checkpoint

CHARS = "abcdefghijklmnopqrstuvwxyzT .,"  # "T": the page's default prompt is "The Transformer"


@pytest.fixture(scope="session")
def lm_checkpoint(tmp_path_factory, peaky):
    out = tmp_path_factory.mktemp("explore-lm")
    tok = CharTokenizer(CHARS, unknown="error")
    torch.manual_seed(0)
    cfg = TransformerConfig.tiny(vocab_size=tok.vocab_size, position="rotary", num_kv_heads=2, max_seq_len=64)
    save_checkpoint(out, model=peaky(DecoderLM(cfg)), tokenizer=tok, kind="lm", step=0, train_config={})
    return out


@pytest.fixture(scope="session")
def code_checkpoint(tmp_path_factory, peaky):
    """A byte-level LM saved as a run on the default corpus (the Python standard library): the page opens on code."""
    out = tmp_path_factory.mktemp("explore-code")
    torch.manual_seed(1)
    cfg = TransformerConfig.tiny(vocab_size=256, position="learned", max_seq_len=96)
    train = {"data": None, "task": None, "pairs": None, "tokenizer": "byte"}
    save_checkpoint(out, model=peaky(DecoderLM(cfg)), tokenizer=ByteTokenizer(), kind="lm", step=0, train_config=train)
    return out


@pytest.fixture(scope="session")
def seq2seq_checkpoint(tmp_path_factory, random_seq2seq):
    out = tmp_path_factory.mktemp("explore-seq2seq")
    tok = CharTokenizer(CHARS, SEQ2SEQ_SPECIALS, unknown="error")
    model = random_seq2seq(vocab=tok.vocab_size, seed=3, dtype=torch.float32, max_seq_len=40)
    save_checkpoint(out, model=model, tokenizer=tok, kind="seq2seq", step=0, train_config={})
    return out


class Client:
    """JSON requests to a running server."""

    def __init__(self, server: ExploreServer) -> None:
        self.host, self.port = server.server_address[:2]

    def request(self, method: str, path: str, body: object = None, raw: bytes | None = None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        try:
            data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            payload = response.read()
            kind = response.getheader("Content-Type", "")
            return response.status, json.loads(payload) if "json" in kind else payload
        finally:
            conn.close()

    def post(self, path: str, body: object):
        return self.request("POST", path, body)


def serve(path):
    """A server of the checkpoint at ``path`` on a free loopback port, in a thread, until the session ends."""
    server = ExploreServer(open_model(path), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture(scope="session")
def lm_server(lm_checkpoint):
    yield from serve(lm_checkpoint)


@pytest.fixture(scope="session")
def seq2seq_server(seq2seq_checkpoint):
    yield from serve(seq2seq_checkpoint)


@pytest.fixture(scope="session")
def code_server(code_checkpoint):
    yield from serve(code_checkpoint)


@pytest.fixture(scope="session")
def code_client(code_server):
    return Client(code_server)


@pytest.fixture(scope="session")
def lm_client(lm_server):
    return Client(lm_server)


@pytest.fixture(scope="session")
def seq2seq_client(seq2seq_server):
    return Client(seq2seq_server)
