"""A k3 tokenizer as GGUF metadata: llama.cpp's `gpt2` (byte-level BPE) tokenizer with a pre-tokenizer type
that splits text exactly as k3's does, and K3's chat template.

k3's tokenizers are byte-level BPE whose pre-tokenizer is the GPT-2 split (`tokenizers`' ByteLevel with its
regex: contractions 's 't 're 've 'm 'll 'd, ` ?` letters, ` ?` digits, ` ?` other symbols, whitespace runs
that leave their last space to the next word). llama.cpp implements that split for several `pre` names; k3
writes `trillion`, which is that split with the detokeniser's GPT-2 space clean-up off (the `gpt-2` name
turns it on: " ." -> ".", " 's" -> "'s"), so text decodes in llama.cpp as in k3. A tokenizer with another
pre-tokenizer, a normaliser, or merges that ignore the BPE ranks is refused rather than written with a split
llama.cpp would not reproduce.

Tokens are the byte-level strings of the vocabulary, by id; special tokens are CONTROL (llama.cpp matches them
in text only when asked to parse specials, as k3's chat encoder inserts them by id), other added tokens
USER_DEFINED; ids past the tokenizer up to the model's vocab_size (embedding rows no token uses) are UNUSED
placeholders. `<|endoftext|>` is the end of text, `<|end_of_msg|>` (when present) the end of a turn, so
llama.cpp stops at either.
"""

import json
from importlib import resources
from pathlib import Path
from typing import Any

from k3.config import K3Config
from k3.hub.folder import ModelFolderError

PRE_TOKENIZER = "trillion"
# llama.cpp's token types (llama_token_type)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
CHAT_TEMPLATE = "chat_template.jinja"
END_OF_TEXT, END_OF_MSG, PAD = "<|endoftext|>", "<|end_of_msg|>", "<|pad|>"


def check_gpt2_split(spec: dict[str, Any]) -> None:
    """Raise ModelFolderError unless tokenizer.json describes a byte-level BPE with the GPT-2 split."""
    pre = spec.get("pre_tokenizer") or {}
    model = spec.get("model") or {}
    problems = []
    if model.get("type") != "BPE":
        problems.append(f"model type {model.get('type')!r} (llama.cpp's gpt2 tokenizer is BPE)")
    if model.get("ignore_merges"):
        problems.append("ignore_merges = true (whole-word lookups before merging; llama.cpp's gpt2 merges)")
    if spec.get("normalizer") is not None:
        problems.append(f"a normalizer ({spec['normalizer'].get('type')})")
    if pre.get("type") != "ByteLevel" or not pre.get("use_regex", True) or pre.get("add_prefix_space"):
        problems.append(f"pre-tokenizer {json.dumps(pre)} (wanted ByteLevel with its GPT-2 regex and no prefix space)")
    if problems:
        raise ModelFolderError(
            "this tokenizer is not the byte-level BPE with the GPT-2 split that llama.cpp can reproduce: "
            + "; ".join(problems)
        )


def merge_list(spec: dict[str, Any]) -> list[str]:
    """The merges as 'left right' strings in rank order (tokenizer.json holds pairs or such strings)."""
    return [m if isinstance(m, str) else f"{m[0]} {m[1]}" for m in spec["model"].get("merges", [])]


def gguf_vocab(tokenizer_path: str | Path, config: K3Config) -> dict[str, Any]:
    """The `tokenizer.*` metadata. Arrays are (values, GGUF element type) so an empty one keeps its type."""
    from k3.formats.tokenizer import K3Tokenizer

    tokenizer = K3Tokenizer.load(tokenizer_path)
    spec = json.loads(tokenizer.tok.to_str())
    check_gpt2_split(spec)
    tok = tokenizer.tok
    n = tok.get_vocab_size(with_added_tokens=True)
    if n > config.vocab_size:
        raise ModelFolderError(
            f"the tokenizer has {n} tokens but the model's vocab_size is {config.vocab_size}; "
            "ids past the embedding could not be computed"
        )
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(config.vocab_size):
        text = tok.id_to_token(i)
        if text is None:
            tokens.append(f"<|k3_unused_{i}|>")
            types.append(UNUSED)
        else:
            tokens.append(text)
            types.append((CONTROL if added[i].special else USER_DEFINED) if i in added else NORMAL)
    vocab: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": PRE_TOKENIZER,
        "tokenizer.ggml.tokens": (tokens, "STRING"),
        "tokenizer.ggml.token_type": (types, "INT32"),
        "tokenizer.ggml.merges": (merge_list(spec), "STRING"),
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
    }
    ids = {"eos": END_OF_TEXT, "eot": END_OF_MSG, "padding": PAD}
    for key, text in ids.items():
        if (i := tok.token_to_id(text)) is not None:
            vocab[f"tokenizer.ggml.{key}_token_id"] = i
    if config.eos_token_id is not None:  # the config's stop token wins, as in k3 generate
        vocab["tokenizer.ggml.eos_token_id"] = config.eos_token_id
    if tokenizer.has_chat_tokens:
        vocab["tokenizer.chat_template"] = chat_template()
    return vocab


def chat_template() -> str:
    """K3's chat format as a Jinja template (conversations without tools), the file beside this module."""
    return resources.files("k3.hub").joinpath(CHAT_TEMPLATE).read_text(encoding="utf-8")
