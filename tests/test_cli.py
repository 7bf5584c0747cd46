"""The `k3` command line."""

import pytest

from k3.cli import main


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
