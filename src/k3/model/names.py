"""Parameter names: the released checkpoint's, and the ones k3 wrote before it used them.

k3's modules carry the released names (SPEC §1), so `K3Model.state_dict()` is the official layout. Up to
the rename, k3 named each layer's AttnRes pseudo-query and key norm after an error in an older SPEC:

    model.layers.{i}.attention_res_proj.weight   ->  model.layers.{i}.self_attention_res_proj.weight
    model.layers.{i}.attention_res_norm.weight   ->  model.layers.{i}.self_attention_res_norm.weight
    model.layers.{i}.ffn_res_proj.weight         ->  model.layers.{i}.mlp_res_proj.weight
    model.layers.{i}.ffn_res_norm.weight         ->  model.layers.{i}.mlp_res_norm.weight

Nothing else changed (the top-level `output_attn_res_*` was always right). `legacy_key` maps one old name
to its released name; run folders (`k3.formats.checkpoint`) and model folders both load through it, so
checkpoints written under the old names keep loading.
"""

import re

# Matches a whole per-layer AttnRes module name under any prefix ("model.", "language_model.model.", or
# none) and with any leaf after it (".weight", or "::exp_avg" for an optimiser state key).
_LEGACY_ATTN_RES = re.compile(r"(?P<head>(?:^|\.)layers\.\d+\.)(?P<old>attention_res|ffn_res)_(?P<part>proj|norm)\b")
_RENAMED = {"attention_res": "self_attention_res", "ffn_res": "mlp_res"}

# The release stores each KDA layer's A_log as this many fp32 values, of which the first num_heads are
# used and the rest are zero (SPEC §1). k3's parameter is (num_heads,): model-folder loading slices the
# padded tensor and exporting pads it back to this size.
RELEASED_A_LOG_SIZE = 128


def legacy_key(name: str) -> str:
    """The released name for a key written under k3's pre-release AttnRes names; any other key unchanged.

    legacy_key("model.layers.3.ffn_res_norm.weight") == "model.layers.3.mlp_res_norm.weight"
    """
    return _LEGACY_ATTN_RES.sub(lambda m: f"{m['head']}{_RENAMED[m['old']]}_{m['part']}", name)


def is_legacy_key(name: str) -> bool:
    """Whether `name` uses a pre-release name, i.e. legacy_key would change it."""
    return legacy_key(name) != name
