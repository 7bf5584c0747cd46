"""`k3 serve` as a user runs it: a subprocess on a k3 init folder, bound to 127.0.0.1; SIGTERM drains the
running stream to its end, refuses new work, and the process exits 0."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from k3.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_ckpt")
    assert main(["init", "--preset", "tiny", "--out", str(path)]) == 0
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_drains_then_exits_0(ckpt):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "k3.cli", "serve", "--model", str(ckpt), "--port", str(port),
                             "--num-pages", "300", "--drain-timeout", "20", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 60, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        events, first = [], threading.Event()

        def read() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["usage"]["completion_tokens"] == 60  # drained to its end, not cut
        assert proc.wait(60) == 0
        out = proc.stdout.read()
        assert f"on http://127.0.0.1:{port}/v1" in out and "k3 serve: stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_refuses_a_bad_max_model_len(ckpt, capsys):
    assert main(["serve", "--model", str(ckpt), "--max-model-len", "10000000", "--port", "1"]) == 2
    assert "--max-model-len 10000000: must be in 1.." in capsys.readouterr().err


def test_docs_list_every_serve_flag():
    """docs/serving.md's table of `k3 serve` flags names each flag the parser has, and no other."""
    import argparse
    import re
    from pathlib import Path

    from k3.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["serve"]._actions for s in a.option_strings} - {"-h", "--help"}
    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    table = [line for line in docs.splitlines() if line.startswith("| --")]
    documented = {f for line in table for f in re.findall(r"--[-\w]+", line.split("|")[1])}
    assert documented == flags
