"""The offline LLM API and `k3 generate` over a checkpoint written by `k3 init`."""

import signal
import threading
import time

import pytest

from k3.cli import main
from k3.serve.llm import LLM
from k3.serve.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("bounded")  # these tests run threads: a hang must not stall the run


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


GREEDY40 = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture
def llm(ckpt):
    """An LLM whose engine loop is stopped at the end, with no loop thread left behind."""
    with LLM(str(ckpt), memory_budget=8 << 20) as model:
        yield model
    assert not any(t.name == "k3-engine-loop" for t in threading.enumerate())


def assert_pool_free(llm: LLM) -> None:
    """No request left and no page held: only free pages and cached (evictable) ones."""
    stats = llm.async_engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["pages_used"] == 0, stats
    llm.engine.pool.check()


def test_generate_while_a_stream_is_open(llm):
    """A stream left open between two next() calls and a generate() in between: each gets its own text (the
    generate used to step the stream's request too, and fail with a KeyError on its output, pages held)."""
    alone_a, alone_b = (llm.generate(p, GREEDY40)[0].text for p in ("a", "b"))
    stream = llm.stream("a", GREEDY40)
    first = next(stream)
    assert llm.generate("b", GREEDY40)[0].text == alone_b
    assert first + "".join(stream) == alone_a
    assert_pool_free(llm)
    assert llm.generate("b", GREEDY40)[0].text == alone_b  # and the LLM still works


def test_streams_read_alternately_lose_no_text(llm):
    prompts = ["def f(x):", "import os", "class A:"]
    want = [o.text for o in llm.generate(prompts, GREEDY40)]
    streams = [llm.stream(p, GREEDY40) for p in prompts]
    got = ["" for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        for i in list(live):
            piece = next(streams[i], None)
            if piece is None:
                live.remove(i)
            else:
                got[i] += piece
    assert got == want
    assert_pool_free(llm)


def test_ctrl_c_inside_generate_frees_every_request(llm, sigint_default):
    """A real SIGINT to the main thread while generate() waits: KeyboardInterrupt comes out of generate, and
    neither its requests nor their pages stay in the engine; the next generate works."""
    want = llm.generate("import os", GREEDY40)[0].text
    engine = llm.engine
    fired = threading.Event()

    def interrupt_once_generating() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                seqs = list(engine.seqs.values())
                started = len(seqs) == 3 and any(s.num_output_tokens >= 3 for s in seqs)
            except RuntimeError:  # the dict changed while it was read: look again
                started = False
            if started:
                fired.set()
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=interrupt_once_generating)
    watcher.start()
    long = SamplingParams(temperature=0, max_tokens=600, ignore_eos=True)
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["def f(x):", "class A:", "x = 1"], long)
    finally:
        watcher.join(timeout=30)
    assert fired.is_set()
    assert_pool_free(llm)
    assert llm.generate("import os", GREEDY40)[0].text == want


def test_outputs_longer_than_the_pool_make_progress(ckpt):
    """reserve_output_fraction=0 admits on the prompt alone; four requests whose outputs cannot all fit the
    pool at once still finish, each preempted at most once (the oldest running request is never the victim;
    newer ones used to preempt older ones in turn, dozens of times). A request that could not finish even
    alone in the pool is refused at once instead of preempting itself forever."""
    with LLM(str(ckpt), num_pages=12, enable_prefix_caching=False, reserve_output_fraction=0.0) as llm:
        params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
        prompts = [list(range(1, 20 + i)) for i in range(4)]  # 3 KDA pages + 7 latent pages each at the end
        outs = llm.generate(prompts, params)
        assert [len(o.token_ids) for o in outs] == [100] * 4 and {o.finish_reason for o in outs} == {"length"}
        assert 0 < llm.async_engine.stats()["preemptions"] <= 3
        assert [o.token_ids for o in outs] == [llm.generate(p, params)[0].token_ids for p in prompts]
        with pytest.raises(ValueError, match=r"needs 13 pages \(19 prompt \+ 150 max tokens\) but the pool has 12"):
            llm.async_engine.submit(prompts[0], SamplingParams(max_tokens=150))
        assert_pool_free(llm)


def test_prompt_beyond_the_context_is_refused(ckpt):
    with LLM(str(ckpt), memory_budget=32 << 20) as llm:
        limit = llm.engine.model.config.max_position_embeddings
        with pytest.raises(
            ValueError,
            match=rf"the prompt's 3 tokens \+ max_tokens {limit - 2:,} = {limit + 1:,} "
            rf"exceed the context of {limit:,} tokens",
        ):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=limit - 2))
        assert llm.generate([1, 2, 3], SamplingParams(max_tokens=4))[0].finish_reason in ("length", "stop")
    with LLM(str(ckpt), memory_budget=32 << 20, max_model_len=10) as llm:
        with pytest.raises(ValueError, match=r"the prompt's 3 tokens \+ max_tokens 8 = 11 exceed the context of 10"):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=8))
        assert len(llm.generate([1, 2, 3], SamplingParams(max_tokens=7, ignore_eos=True))[0].token_ids) == 7
    with pytest.raises(ValueError, match=r"max_model_len 5000 must be in \[1, 4096\]"):
        LLM(str(ckpt), memory_budget=32 << 20, max_model_len=5000)


def test_cli_generate_uses_the_engine(ckpt, capsys):
    assert main(["generate", "--ckpt", str(ckpt), "--max-tokens", "5", "--temperature", "0", "hello"]) == 0
    plain = capsys.readouterr().out
    assert main(["generate", "--ckpt", str(ckpt), "--max-tokens", "5", "--temperature", "0", "--stream", "hello"]) == 0
    assert capsys.readouterr().out == plain and plain.startswith("hello")
    assert main(["generate", "--ckpt", str(ckpt), "--top-p", "2", "hello"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
    # the pool sized in pages instead of bytes: --verbose prints its capacity at start-up; too small says why
    assert (
        main(
            [
                "generate",
                "--ckpt",
                str(ckpt),
                "--max-tokens",
                "5",
                "--temperature",
                "0",
                "--num-pages",
                "40",
                "--verbose",
                "hello",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert out.out == plain and "page pool: 40 pages" in out.err
    assert main(["generate", "--ckpt", str(ckpt), "--num-pages", "2", "hello"]) == 2
    assert "needs" in capsys.readouterr().err


@pytest.fixture(scope="module")
def packed_folder(ckpt, tmp_path_factory):
    """The k3 init checkpoint exported with its routed experts MXFP4-packed, as the release stores them."""
    from k3.hub import export_model

    return export_model(ckpt, tmp_path_factory.mktemp("packed") / "m", quantize="mxfp4")


def test_llm_serves_from_packed_mxfp4_experts(packed_folder):
    """quantization='mxfp4' keeps the experts packed in the engine's model: the same logits and greedy tokens as
    the load that decodes them to dense fp32 weights (both compute from unpack(pack(w))), bitwise, with the
    routed experts' resident bytes 128/17 times smaller."""
    import torch

    from k3.model.quantization import routed_expert_bytes
    from k3.quant import MXFP4Linear

    dense = LLM(model=str(packed_folder), memory_budget=8 << 20)
    packed = LLM(model=str(packed_folder), quantization="mxfp4", memory_budget=8 << 20)
    model = packed.engine.model
    config = model.config
    experts = [m for n, m in model.named_modules() if ".experts." in n and n.endswith(("w1", "w2", "w3"))]
    assert experts and all(isinstance(m, MXFP4Linear) for m in experts)
    moe_layers = config.num_hidden_layers - config.first_k_dense_replace
    weights = moe_layers * config.num_experts * 3 * config.routed_expert_hidden_size * config.moe_intermediate_size
    dense_bytes, packed_bytes = routed_expert_bytes(dense.engine.model), routed_expert_bytes(model)
    assert dense_bytes == 4 * weights and packed_bytes == weights * 17 // 32
    assert dense_bytes / packed_bytes >= 6

    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = ["def f(x):", "import os", "class A:\n    pass"]
    got, want = packed.generate(prompts, greedy), dense.generate(prompts, greedy)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert not any(m.training for m in model.modules())  # the engine serves it in eval mode, without gradients
    ids = torch.tensor([[3, 70, 101, 9, 250, 44, 12, 0, 200, 17]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, dense.engine.model(ids).logits)
    with pytest.raises(ValueError, match=r"quantization 'fp8'"):
        LLM(model=str(packed_folder), quantization="fp8")


def test_dense_folders_and_run_folders_are_packed_at_load(ckpt, packed_folder, tmp_path):
    """A dense model folder or a run folder loaded with quantization='mxfp4' holds the bytes k3 export
    --quantize mxfp4 writes for the same weights."""
    import torch

    from k3.hub import export_model, load_pretrained

    dense_folder = export_model(ckpt, tmp_path / "dense", shard_size=20_000)
    want = load_pretrained(packed_folder, quantization="mxfp4").model.state_dict()
    for source in (dense_folder, ckpt):
        got = load_pretrained(source, quantization="mxfp4").model.state_dict()
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(got[name], t), (source, name)


def test_cli_generate_with_packed_experts(packed_folder, capsys):
    argv = ["generate", "--model", str(packed_folder), "--max-tokens", "6", "--temperature", "0", "hello"]
    assert main(argv) == 0
    dense = capsys.readouterr()
    assert main([*argv, "--quantization", "mxfp4"]) == 0
    packed = capsys.readouterr()
    assert packed.out == dense.out and packed.out.startswith("hello")
    assert "routed experts: MXFP4-packed" in packed.err and "7.53x less than fp32" in packed.err
    assert "routed experts" not in dense.err
