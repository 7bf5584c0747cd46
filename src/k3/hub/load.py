"""Loading a model for inference (or to start training from), from any folder k3 knows:

    a model folder   config.json + safetensors in the release layout (k3 export writes one)
    a run folder     k3 train's output: its newest step_*/ checkpoint, and tokenizer.json
    a step folder    one step_XXXXXXXX/ checkpoint of a run

Serving (`LLM`, `k3 generate`) and training (`k3 train --init-from`) both come here; neither owns it.

Dtype rule: every floating-point tensor is converted to the model's dtype (`dtype`, default float32, the
dtype k3 computes in on a CPU; bf16 -> fp32 is exact), except those the release stores in F32 (KDA's short
convolutions, o_norm, A_log, dt_bias: k3.model.model.KEEP_FP32), which a bf16 model keeps in fp32.
MXFP4-packed experts are decoded to the model's dtype.
A model folder is read shard by shard and tensor by tensor into a model allocated once, so the memory
peak is the model plus the tensor being read (plus its partner, for a packed expert weight).

Quantization (`quantization=`, vLLM's keyword): None keeps every weight dense, decoding packed experts as
above. "mxfp4" keeps the routed experts MXFP4-packed in memory (k3.quant.MXFP4Linear, dequantised per
expert per forward; 17/32 of a byte per weight): a packed folder's uint8 bytes are copied into the
packed buffers as they are, never decoded; a dense folder's expert weights are packed one at a time as
they are read (from the stored values, before any dtype conversion); a run or step folder is loaded
dense, then packed. The same weights give the same bytes whichever way they come in.
"""

import weakref
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from k3.config import K3Config
from k3.hub.folder import ModelFolder, ModelFolderError
from k3.hub.layout import EXPERT_WEIGHT, LoadPlan, plan_load
from k3.model import K3Model
from k3.model.names import RELEASED_A_LOG_SIZE

QUANTIZATIONS = (None, "mxfp4")  # how routed experts are held in memory: dense, or MXFP4-packed


def check_quantization(quantization: str | None) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization {quantization!r}: k3 keeps routed experts dense (None) or MXFP4-packed ('mxfp4')"
        )


@dataclass
class ReadStats:
    """What a folder load read: bytes read in all, and the most bytes of read-but-not-yet-freed tensors
    alive at one moment (each read tensor is tracked until it is garbage: an honest peak, not an estimate)."""

    bytes_read: int = 0
    alive_bytes: int = 0
    peak_alive_bytes: int = 0
    tensors_read: int = 0

    def track(self, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        self.bytes_read += n
        self.tensors_read += 1
        self.alive_bytes += n
        self.peak_alive_bytes = max(self.peak_alive_bytes, self.alive_bytes)
        weakref.finalize(t, self._free, n)
        return t

    def _free(self, n: int) -> None:
        self.alive_bytes -= n


@dataclass
class Pretrained:
    """A loaded model and what came with it."""

    model: K3Model
    config: K3Config
    tokenizer_path: Path | None  # tokenizer.json, None when the folder has none
    path: Path  # the folder the weights were read from (a run folder resolves to its newest step)
    kind: str  # "model folder" or "checkpoint"
    skipped: list[str]  # tensors of unbuilt parts skipped with text_only
    quantization: str | None = None  # "mxfp4": the routed experts are held packed (module docstring)


def folder_kind(path: str | Path) -> str:
    """'model folder' (config.json), 'checkpoint' (a run or step folder), or a ModelFolderError."""
    path = Path(path)
    if not path.exists():
        raise ModelFolderError(f"{path}: no such checkpoint, run or model folder")
    if (path / "meta.json").exists() or any(path.glob("step_*/meta.json")):
        return "checkpoint"
    if (path / "config.json").exists():
        return "model folder"
    raise ModelFolderError(
        f"{path} is neither a model folder (config.json + safetensors) nor a run or step folder (step_*/meta.json)"
    )


def _expected_shapes(config: K3Config, dtype: torch.dtype) -> tuple[K3Model, dict[str, torch.Size]]:
    """A model on the meta device (no memory) and its state_dict shapes."""
    with torch.device("meta"):
        model = K3Model(config).cast(dtype)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the same tensor as the input embedding
    return model, expected


def load_model_folder(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    text_only: bool = False,
    stats: ReadStats | None = None,
    quantization: str | None = None,
) -> tuple[K3Model, LoadPlan]:
    """A K3Model (eval mode) from a model folder. Names, shapes and dtypes of every tensor are checked
    against the config from the headers first; then tensors are read one at a time into the model.
    quantization="mxfp4" keeps the routed experts packed (module docstring)."""
    from k3.model.quantization import allocate_packed_experts
    from k3.quant import mx

    check_quantization(quantization)
    folder = ModelFolder.open(path)
    config = K3Config.from_hf(folder.config_dict)
    if text_only and config.vision_config is not None:  # the language model alone: no tower is built
        config = replace(config, vision_config=None)
    meta_model, expected = _expected_shapes(config, dtype)
    plan = plan_load(folder.tensors, expected, text_only=text_only)  # against the dense shapes, packed or not
    if quantization == "mxfp4":
        allocate_packed_experts(meta_model)
    model = meta_model.to_empty(device=device)  # every entry is overwritten below (plan_load checked)
    own = model.state_dict()
    stats = stats if stats is not None else ReadStats()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    with torch.no_grad():
        for file in folder.files:
            try:
                handle = safe_open(folder.path / file, framework="pt", device="cpu")
            except (SafetensorError, OSError) as e:
                raise ModelFolderError(f"{folder.path / file}: cannot be read as safetensors ({e})") from e
            with handle:
                for name in folder.names_in(file):
                    place = plan.placements.get(name)
                    if place is None:  # a skipped part: never read
                        continue
                    t = stats.track(handle.get_tensor(name))
                    if quantization == "mxfp4" and EXPERT_WEIGHT.search(place.target):
                        base = place.target[: -len("weight")]
                        if place.kind == "copy":  # a dense expert weight: packed from its stored values
                            packed, scale = mx.pack_mxfp4(t)
                            own[base + "weight_packed"].copy_(stats.track(packed))
                            own[base + "weight_scale"].copy_(stats.track(scale))
                            del packed, scale
                        else:  # one half of a packed one: its bytes, as they are
                            own[base + "weight_" + place.kind].copy_(t)
                        del t
                        continue
                    param = own[place.target]
                    if place.kind == "copy":
                        param.copy_(t)
                    elif place.kind == "a_log":
                        t = t.reshape(-1)  # Kimi Linear's [1, 1, H, 1]
                        n = param.shape[0]
                        if t.shape[0] != n and t[n:].count_nonzero():
                            raise ModelFolderError(
                                f"{name}: the padded A_log [{RELEASED_A_LOG_SIZE}] holds "
                                f"nonzero values past num_heads = {n}: the config and the "
                                f"weights disagree on the number of KDA heads"
                            )
                        param.copy_(t[:n])
                    else:
                        halves = pending.setdefault(place.target, {})
                        halves[place.kind] = t
                        if len(halves) == 2:
                            del pending[place.target]
                            # fp64 decodes every E8M0 scale exactly; fp32 all but the top few (~2^127)
                            wide = torch.float64 if param.dtype == torch.float64 else torch.float32
                            param.copy_(stats.track(mx.unpack_mxfp4(halves["packed"], halves["scale"], wide)))
                            del halves
                    del t
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval(), plan


def load_pretrained(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    text_only: bool = False,
    stats: ReadStats | None = None,
    quantization: str | None = None,
) -> Pretrained:
    """The model (eval mode) of a model folder, a run folder or a step folder; quantization="mxfp4" holds
    its routed experts MXFP4-packed (module docstring)."""
    from k3.formats.checkpoint import load_checkpoint
    from k3.model.quantization import pack_experts

    check_quantization(quantization)
    path = Path(path)
    if folder_kind(path) == "model folder":
        model, plan = load_model_folder(path, dtype, device, text_only, stats, quantization)
        tokenizer = path / "tokenizer.json"
        return Pretrained(
            model,
            model.config,
            tokenizer if tokenizer.exists() else None,
            path,
            "model folder",
            plan.skipped,
            quantization,
        )
    ckpt = load_checkpoint(path)
    config = ckpt.config
    with torch.device(device):
        model = K3Model(config)
    ckpt.load_model(model)
    if quantization == "mxfp4":  # model.safetensors is read whole anyway: dense, then packed (stored values)
        pack_experts(model)
    model = model.cast(dtype).eval()
    tokenizer = ckpt.path.parent / ckpt.state.get("tokenizer", "tokenizer.json")
    return Pretrained(
        model, config, tokenizer if tokenizer.exists() else None, ckpt.path, "checkpoint", [], quantization
    )


def load_tokenizer(pretrained: Pretrained):
    """The K3Tokenizer that came with a loaded model; an error if there is none or it does not fit."""
    from k3.formats.tokenizer import K3Tokenizer

    if pretrained.tokenizer_path is None:
        where = "the model folder" if pretrained.kind == "model folder" else "the run folder"
        raise ModelFolderError(f"{pretrained.path}: no tokenizer.json in {where}; generating text needs one")
    tokenizer = K3Tokenizer.load(pretrained.tokenizer_path)
    if tokenizer.vocab_size > pretrained.config.vocab_size:
        raise ModelFolderError(
            f"{pretrained.tokenizer_path} has {tokenizer.vocab_size} tokens, the model only "
            f"{pretrained.config.vocab_size}"
        )
    return tokenizer


def load_for_inference(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    text_only: bool = False,
    quantization: str | None = None,
):
    """(model in eval mode, tokenizer) from a model folder, a run folder or a step folder."""
    pretrained = load_pretrained(path, dtype=dtype, device=device, text_only=text_only, quantization=quantization)
    return pretrained.model, load_tokenizer(pretrained)
