"""k3.ops.compute_dtype: `dtype="auto"` decided from the CPU's flags and measured matmul rates, the measurement kept
per machine in a cache file (a corrupt one is measured again), names parsed with readable errors, and LLM/CLI
taking the choice."""

import json

import pytest
import torch

from k3.ops import compute_dtype
from k3.ops.compute_dtype import parse_dtype, resolve_dtype


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """A machine whose flags and matmul rates the test sets: (flags set, rates dict, measured calls list)."""
    monkeypatch.setattr(compute_dtype, "_cache_file", lambda: tmp_path / "compute_dtype.json")  # not the kernels'
    compute_dtype.matmul_rates.cache_clear()
    flags, rates, calls = {"avx2", "avx512f", "avx512_bf16"}, {torch.float32: 100.0, torch.bfloat16: 250.0}, []
    monkeypatch.setattr(compute_dtype, "_cpu_flags", lambda: flags)

    def measure(dtype, reps=5):
        calls.append(dtype)
        return rates[dtype]

    monkeypatch.setattr(compute_dtype, "_measure", measure)
    yield flags, rates, calls
    compute_dtype.matmul_rates.cache_clear()


def test_names():
    assert parse_dtype("bf16") is torch.bfloat16 and parse_dtype("float32") is torch.float32
    assert parse_dtype(torch.float64) is torch.float64 and parse_dtype("auto") == "auto"
    with pytest.raises(ValueError, match=r"must be auto or one of float32, bfloat16, float64, float16, got 'int8'"):
        parse_dtype("int8")
    with pytest.raises(ValueError, match=r"torch\.int8 is not one of"):
        parse_dtype(torch.int8)
    choice = resolve_dtype("float32")
    assert choice.dtype is torch.float32 and choice.reason == "as asked"


def test_auto_follows_the_measured_rates(machine):
    _, rates, _ = machine
    choice = resolve_dtype("auto")
    assert choice.dtype is torch.bfloat16 and "2.50×" in choice.reason and "≥ 1.5×" in choice.reason
    assert (choice.fp32_gflops, choice.bf16_gflops) == (100.0, 250.0)
    rates[torch.bfloat16] = 120.0  # a CPU whose bf16 is barely faster: fp32
    compute_dtype.matmul_rates.cache_clear()
    compute_dtype._cache_file().unlink()  # measured again
    assert resolve_dtype("auto").dtype is torch.float32


def test_no_native_bf16_is_fp32_without_measuring(machine):
    flags, _, calls = machine
    flags.discard("avx512_bf16")  # Zen 3: bf16 matmul 80-400x slower than fp32
    choice = resolve_dtype("auto")
    assert choice.dtype is torch.float32 and "no native bf16" in choice.reason and calls == []


def test_the_measurement_is_kept_per_machine(machine):
    _, _, calls = machine
    resolve_dtype("auto")
    assert calls == [torch.float32, torch.bfloat16]
    compute_dtype.matmul_rates.cache_clear()  # a new process
    resolve_dtype("auto")
    assert calls == [torch.float32, torch.bfloat16]  # read from the file, not measured again
    path = compute_dtype._cache_file()
    (entry,) = json.loads(path.read_text()).values()
    assert entry == {"fp32_gflops": 100.0, "bf16_gflops": 250.0}
    path.write_text("{not json")  # a corrupt file: measured again, and rewritten whole
    compute_dtype.matmul_rates.cache_clear()
    assert resolve_dtype("auto").dtype is torch.bfloat16 and len(calls) == 4
    assert json.loads(path.read_text())


def test_cli_and_llm_take_the_choice(tmp_path, machine, capsys):
    from k3.cli import main as k3
    from k3.serve.llm import LLM

    run = tmp_path / "run"
    assert k3(["init", "--preset", "tiny", "--out", str(run)]) == 0
    with LLM(str(run), dtype="auto", num_pages=64) as llm:
        assert llm.dtype_choice.dtype is torch.bfloat16
        assert next(llm.engine.model.parameters()).dtype is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be auto or one of"):
        LLM(str(run), dtype="fp8")
    assert k3(["generate", "--model", str(run), "--dtype", "auto", "--max-tokens", "3", "hi"]) == 0
    assert "k3 generate: dtype bfloat16 (auto: bf16 matmul 250 GFLOP/s" in capsys.readouterr().err
