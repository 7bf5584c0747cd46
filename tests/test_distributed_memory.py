"""`k3 params --ep N --dp M`: the per-rank training memory adds up from the model's own parameter list."""

import pytest

from k3.cli import main
from k3.config import K3Config
from k3.model.params import count_parameters
from k3.train.rank_memory import FP32, MXFP4_BYTES, rank_memory


def test_rank_memory_splits_the_experts_over_ep_and_the_rest_over_dp():
    config = K3Config.from_preset("tiny")  # 8 experts
    counts = count_parameters(config)
    routed = counts["routed_experts"]["total"]
    rest = sum(c["total"] for c in counts.values()) - routed
    m = rank_memory(config, ep=2, dp=4, micro_batch_tokens=64)
    assert m["experts_per_rank"] == 4 and m["expert_split_even"]
    assert m["routed_params_per_rank"] == routed / 2
    assert m["replicated_params_per_rank"] == pytest.approx(rest / 4)
    assert m["parts"]["routed_experts_fp32"] == routed / 2 * FP32
    assert m["parts"]["gradients_fp32"] == pytest.approx((routed / 2 + rest / 4) * FP32)
    assert m["expert_copy_mxfp4"] == pytest.approx(routed / 2 * MXFP4_BYTES)
    assert m["total"] == pytest.approx(sum(m["parts"].values()))
    uneven = rank_memory(config, ep=3, dp=3)
    assert uneven["experts_per_rank"] == 3 and not uneven["expert_split_even"]
    with pytest.raises(ValueError, match="multiple of --ep"):
        rank_memory(config, ep=2, dp=3)


def test_k3_params_prints_the_per_rank_table(capsys):
    assert main(["params", "--preset", "tiny", "--ep", "2", "--dp", "4"]) == 0
    out = capsys.readouterr().out
    assert "Training memory per rank at EP = 2, FSDP over 4 ranks" in out and "MXFP4" in out
    assert main(["params", "--preset", "tiny", "--ep", "2", "--dp", "3"]) == 2
    assert "multiple of --ep" in capsys.readouterr().err
