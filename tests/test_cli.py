"""The `k3` command line."""

import pytest

from k3.cli import main
from k3.ops.kda.backend import fla_version


def test_env_reports_the_cpu_backend(capsys, monkeypatch):
    monkeypatch.delenv("K3_KDA_BACKEND", raising=False)
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "KDA backend on cpu" in out and out.split("KDA backend on cpu")[1].split()[0] == "torch"
    assert "torch" in out and "cpu threads" in out


def test_unknown_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_env_with_an_impossible_backend_says_why_instead_of_a_traceback(capsys, monkeypatch):
    """K3_KDA_BACKEND=fla on a machine without CUDA: `k3 env` reports it, and fla's version."""
    monkeypatch.setenv("K3_KDA_BACKEND", "fla")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if row.startswith("KDA backend on cpu"))
    assert "error: K3_KDA_BACKEND=fla cannot run chunk_kda here" in line and "cuda tensors" in line
    fla = next(row for row in out.splitlines() if row.startswith("flash-linear-attention"))
    version = fla_version()
    assert fla.split(maxsplit=1)[1].startswith(f"{version}:" if version else "not installed")
