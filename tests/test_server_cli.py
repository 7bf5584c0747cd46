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
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "k3.cli",
            "serve",
            "--model",
            str(ckpt),
            "--port",
            str(port),
            "--num-pages",
            "300",
            "--drain-timeout",
            "20",
            "--served-model-name",
            "tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
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
        body = {
            "model": "tiny",
            "prompt": "def f(x):",
            "max_tokens": 60,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        }
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


def test_the_write_and_keep_alive_timeout_flags_reach_the_server(ckpt, monkeypatch, capsys):
    """--write-timeout and --keep-alive-timeout become ServerLimits' write_timeout_s (the guard's deadline on
    each response write) and keep_alive_timeout_s (uvicorn's timeout_keep_alive); 0 is refused before the
    model loads. What each does on a connection: test_server_hostile.py."""
    import k3.server.main as server_main
    from k3.server import ServerLimits

    seen = {}
    monkeypatch.setattr(server_main, "serve", lambda model, host, port, **kw: seen.update(kw["limits"]) or 0)
    assert main(["serve", "--model", str(ckpt), "--write-timeout", "2.5", "--keep-alive-timeout", "0.75"]) == 0
    limits = ServerLimits(max_model_len=64, **seen)
    assert (limits.write_timeout_s, limits.keep_alive_timeout_s) == (2.5, 0.75)
    assert server_main.uvicorn_options(limits)["timeout_keep_alive"] == 0.75
    seen.clear()
    assert main(["serve", "--model", str(ckpt)]) == 0  # the flags' defaults are ServerLimits' own
    defaults = ServerLimits(max_model_len=64)
    assert (seen["write_timeout_s"], seen["keep_alive_timeout_s"]) == (defaults.write_timeout_s, 5.0)
    monkeypatch.undo()
    assert main(["serve", "--model", str(ckpt), "--write-timeout", "0", "--port", "1"]) == 2
    assert "write_timeout_s must be a number > 0" in capsys.readouterr().err


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


class Served:
    """`k3 serve` in a subprocess on a free port, ready for requests; `.out` is everything it printed once it
    has exited."""

    def __init__(self, ckpt, *flags: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [
            sys.executable,
            "-m",
            "k3.cli",
            "serve",
            "--model",
            str(ckpt),
            "--port",
            str(self.port),
            "--num-pages",
            "300",
            "--served-model-name",
            "tiny",
            *flags,
        ]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None and time.monotonic() < deadline, self.proc.stdout.read()
            time.sleep(0.1)

    def stream(self, max_tokens: int) -> tuple[list[str], threading.Event, threading.Thread]:
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        events, first = [], threading.Event()

        def read() -> None:
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[len("data: ") :])
                            first.set()
            except httpx.TransportError:
                events.append(None)  # cut: a stop that did not drain

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30)
        return events, first, reader

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        self.out = self.proc.stdout.read()
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def test_draining_keeps_listening_then_aborts_streams_past_the_deadline_cleanly(ckpt):
    """During the drain /health is 503 "draining" and new /v1 requests 503 (the listener stays open); a stream
    still running at --drain-timeout ends with an error event and [DONE]; exit 0; no traceback in the log."""
    served = Served(ckpt, "--drain-timeout", "1.5")
    try:
        events, _, reader = served.stream(max_tokens=2000)  # far longer than the drain allows
        served.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(served.url + "/health", timeout=5)
        assert health.status_code == 503 and health.json() == {"status": "draining"}
        late = httpx.post(served.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down"
        reader.join(60)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "shutting_down" and "shut down before this request finished" in error["message"]
        assert served.wait() == 0
        assert "Traceback" not in served.out and "CancelledError" not in served.out, served.out
        assert "k3 serve: stopped" in served.out
    finally:
        served.kill()


def test_a_second_signal_stops_at_once_with_128_plus_the_signal(ckpt):
    served = Served(ckpt, "--drain-timeout", "60")
    try:
        events, _, reader = served.stream(max_tokens=2000)
        served.proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        start = time.monotonic()
        served.proc.send_signal(signal.SIGINT)
        assert served.wait(30) == 130  # as a shell reports a command killed by Ctrl-C, not 0
        assert time.monotonic() - start < 15
        assert "stopped without draining (SIGINT twice)" in served.out
        reader.join(30)
        assert events[-1] != "[DONE]"  # cut, not drained
    finally:
        served.kill()


def test_a_busy_port_is_an_error_before_the_model_loads(ckpt, capsys):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", "--model", str(ckpt / "nowhere"), "--port", str(port)]) == 2
        assert time.monotonic() - start < 5
    err = capsys.readouterr()
    assert f"cannot listen on 127.0.0.1:{port}" in err.err and "on http://" not in err.out
