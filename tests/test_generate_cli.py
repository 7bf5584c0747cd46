"""`k3 generate` as a user meets it: its sampling flags, stdin, the context check before any loading, a quiet
default, Ctrl-C and a closed pipe without tracebacks, and the suggested command's real newline."""

import io
import os
import shutil
import subprocess
import sys

import pytest
import torch

from k3.cli import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, main, next_generate
from k3.serve.llm import LLM
from k3.serve.sampling import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    assert main(["init", "--preset", "tiny", "--out", str(path)]) == 0
    return path


def generate(capsys, ckpt, *flags: str, prompt: str = "hello") -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["generate", "--ckpt", str(ckpt), "--max-tokens", "8", *flags, prompt])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_top_k_one_is_greedy(ckpt, capsys):
    rc, greedy, _ = generate(capsys, ckpt, "--temperature", "0")
    assert rc == 0
    rc, top1, _ = generate(capsys, ckpt, "--temperature", "1.5", "--top-k", "1", "--top-p", "1")
    assert rc == 0 and top1 == greedy
    rc, _, err = generate(capsys, ckpt, "--top-k", "-2")
    assert rc == 2 and "top_k must be" in err


def test_stop_strings_end_the_output_before_them(ckpt, capsys):
    rc, full, _ = generate(capsys, ckpt, "--temperature", "0", "--max-tokens", "24")
    text = full[len("hello") : -1]  # the generated part, without the final newline
    assert rc == 0 and len(text) >= 6
    stop, other = text[3:5], "\x00never"  # two stops; the one that occurs ends the text just before it
    rc, out, _ = generate(capsys, ckpt, "--temperature", "0", "--max-tokens", "24", "--stop", other, "--stop", stop)
    assert rc == 0 and out == "hello" + text[: text.index(stop)] + "\n"


def test_n_completions_with_seeds_each_a_request_of_its_own(ckpt, capsys):
    flags = ("--temperature", "1.0", "--top-p", "1", "-n", "3", "--seed", "5")
    rc, out, _ = generate(capsys, ckpt, *flags)
    assert rc == 0
    llm = LLM(str(ckpt), memory_budget=8 << 20)
    want = [llm.generate("hello", SamplingParams(temperature=1.0, max_tokens=8, seed=5 + i))[0].text for i in range(3)]
    assert out == "".join(f"--- completion {i + 1} of 3 ---\nhello{t}\n" for i, t in enumerate(want))
    assert len(set(want)) > 1  # completion i is seeded with seed + i: not three copies of one
    rc, streamed, _ = generate(capsys, ckpt, *flags, "--stream")
    assert rc == 0 and streamed == out
    rc, _, err = generate(capsys, ckpt, "-n", "0")
    assert rc == 2 and "-n 0" in err


def test_prompt_from_stdin(ckpt, capsys, monkeypatch):
    rc, direct, _ = generate(capsys, ckpt, "--temperature", "0", prompt="def f(x):\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("def f(x):\n"))
    rc2, piped, _ = generate(capsys, ckpt, "--temperature", "0", prompt="-")
    assert rc == rc2 == 0 and piped == direct and piped.startswith("def f(x):\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    rc, _, err = generate(capsys, ckpt, prompt="-")
    assert rc == 2 and "the prompt is empty (stdin gave nothing)" in err


def test_context_overflow_is_refused_before_loading(ckpt, capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded before the context check")

    monkeypatch.setattr(LLM, "__init__", no_load)
    # "hello" is 5 byte-level tokens: 5 + 8 > 12
    rc, _, err = generate(capsys, ckpt, "--max-model-len", "12")
    assert rc == 2
    assert err == (
        "k3 generate: the prompt's 5 tokens + --max-tokens 8 = 13 exceed the context of 12 tokens "
        "(--max-model-len); shorten the prompt or lower --max-tokens\n"
    )
    rc, _, err = generate(capsys, ckpt, "--max-model-len", "5000")
    assert rc == 2 and "--max-model-len 5000 exceeds the model's max_position_embeddings (4,096)" in err
    capsys.readouterr()
    assert main(["generate", "--ckpt", str(ckpt), "--max-tokens", "4093", "hello"]) == 2
    assert "5 tokens + --max-tokens 4,093 = 4,098 exceed the context of 4,096 tokens" in capsys.readouterr().err
    monkeypatch.undo()
    rc, out, _ = generate(capsys, ckpt, "--max-model-len", "13", "--temperature", "0")  # 5 + 8 fits exactly
    assert rc == 0 and out.startswith("hello")


def test_pool_report_only_with_verbose(ckpt, capsys):
    rc, quiet, err = generate(capsys, ckpt, "--temperature", "0")
    assert rc == 0 and err == ""
    rc, loud, err = generate(capsys, ckpt, "--temperature", "0", "--verbose")
    assert rc == 0 and loud == quiet and err.startswith("page pool: ") and len(err.splitlines()) >= 5


def test_device_is_checked_before_loading(ckpt, capsys):
    rc, _, err = generate(capsys, ckpt, "--device", "tpu")
    assert rc == 2 and "--device 'tpu' is not a device name" in err
    if not torch.cuda.is_available():
        rc, _, err = generate(capsys, ckpt, "--device", "cuda")
        assert rc == 2 and "torch sees no CUDA device here" in err
    rc, out, _ = generate(capsys, ckpt, "--device", "cpu", "--temperature", "0")
    assert rc == 0 and out.startswith("hello")


def test_ctrl_c_is_one_line_and_exit_130(ckpt, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "generate", interrupted)
    rc, out, err = generate(capsys, ckpt)
    assert rc == EXIT_INTERRUPTED == 130 and out == "" and err == "k3 generate: interrupted\n"

    def stream(self, prompt, params):
        yield " world"
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "stream", stream)
    rc, out, err = generate(capsys, ckpt, "--stream")
    # the unfinished streamed line is not continued by the message
    assert rc == 130 and out == "hello world" and err == "\nk3 generate: interrupted\n"


def test_closed_stdout_exits_quietly(ckpt):
    """`k3 generate --stream … | head -1` once head has exited: the first write meets a closed pipe."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written: every write fails with EPIPE
    try:
        code = "import sys; from k3.cli import main; sys.exit(main(sys.argv[1:]))"
        argv = [sys.executable, "-c", code, "generate", "--ckpt", str(ckpt), "--max-tokens", "4", "--stream", "hi"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(argv, stdout=write, stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    finally:
        os.close(write)
    assert done.returncode == EXIT_BROKEN_PIPE == 141
    assert done.stderr == ""  # no traceback, and no "Exception ignored" from the flush at exit


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash for $'...' quoting")
def test_suggested_command_passes_a_real_newline(tmp_path):
    line = next_generate(tmp_path / "a run")
    # a `k3` shell function stands in for the command and prints its arguments one per line, NUL-ended
    script = 'k3() { printf "%s\\0" "$@"; }\n' + line
    got = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split("\0")[:-1]
    assert got[-1] == "import os\n"
    assert got[got.index("--model") + 1] == str(tmp_path / "a run")


def test_a_fallback_to_an_older_step_is_reported_once(ckpt, tmp_path, capsys):
    import warnings

    from k3.formats.checkpoint import CheckpointWarning

    run = tmp_path / "run"
    shutil.copytree(ckpt, run)
    newest = run / "step_00000001"
    shutil.copytree(run / "step_00000000", newest)
    (newest / "meta.json").write_text("{ torn")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc, out, _ = generate(capsys, run, "--temperature", "0")
    assert rc == 0 and out.startswith("hello")
    assert [str(w.message).count("step_00000000") for w in caught if w.category is CheckpointWarning] == [1]


def test_docs_list_every_generate_flag():
    """docs/serving.md's table of `k3 generate` flags names each flag the parser has, and no other."""
    import argparse
    import re
    from pathlib import Path

    from k3.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {s for a in sub.choices["generate"]._actions for s in a.option_strings} - {"-h", "--help"}
    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    table = [line for line in docs.splitlines() if line.startswith("| `-")]
    documented = {f.split()[0] for line in table for f in re.findall(r"`(-[-\w]+(?: \w+)?)`", line.split("|")[1])}
    assert documented == flags
