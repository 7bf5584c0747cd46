"""The offline LLM API and `k3 generate` over a checkpoint written by `k3 init`."""

import pytest

from k3.cli import main
from k3.serve.llm import LLM
from k3.serve.sampling import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt")
    assert main(["init", "--preset", "tiny", "--out", str(path)]) == 0
    return path


def test_generate_stream_and_abort(ckpt):
    llm = LLM(str(ckpt), memory_budget=8 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(["def f(x):", "import os", "class A:"], greedy)
    assert [o.prompt for o in outs] == ["def f(x):", "import os", "class A:"]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    again = llm.generate("import os", greedy)[0]
    assert again.token_ids == outs[1].token_ids  # the same request alone gives the same tokens
    streamed = "".join(llm.stream("import os", greedy))
    assert streamed == outs[1].text
    first = next(iter(llm.stream("def f(x):", SamplingParams(max_tokens=50, ignore_eos=True))), None)
    assert first is not None  # the generator was abandoned after one piece: its pages must come back
    assert llm.engine.pool.num_used == 0 and not llm.engine.has_unfinished()
    seeded = [llm.generate("x = ", SamplingParams(temperature=1.0, max_tokens=8, seed=3))[0].text for _ in range(2)]
    assert seeded[0] == seeded[1]
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate(["a", "b"], [greedy])
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate(["fine", ""], greedy)
    assert not llm.engine.has_unfinished() and llm.engine.pool.num_used == 0  # "fine" was not left queued


def test_cli_generate_uses_the_engine(ckpt, capsys):
    assert main(["generate", "--ckpt", str(ckpt), "--max-tokens", "5", "--temperature", "0", "hello"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--ckpt", str(ckpt), "--max-tokens", "5", "--temperature", "0", "--stream", "hello"]) == 0
    assert capsys.readouterr().out == plain and plain.startswith("hello")
    assert main(["generate", "--ckpt", str(ckpt), "--top-p", "2", "hello"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    # the pool sized in pages instead of bytes: its capacity is printed at start-up; too small says why
    assert main(["generate", "--ckpt", str(ckpt), "--max-tokens", "5", "--temperature", "0", "--num-pages", "40",
                 "hello"]) == 0  # fmt: skip
    out = capsys.readouterr()
    assert out.out == plain and "page pool: 40 pages" in out.err
    assert main(["generate", "--ckpt", str(ckpt), "--num-pages", "2", "hello"]) == 2
    assert "needs" in capsys.readouterr().err
