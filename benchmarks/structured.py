"""Structured outputs: what a grammar costs per token, and what it does to the engine's decode speed.

    python benchmarks/structured.py            # ~3 min: the 8K and the 164K vocabulary
    python benchmarks/structured.py --quick    # ~40 s: the 8K vocabulary only

Vocabularies: byte-level BPEs trained like the quickstart's, on the standard library's source (8,192 tokens),
and on it plus 80 MB of site-packages source (163,840 tokens, the released model's count; ~1 min to train).
Masks: a realistic document for each grammar (any JSON object; a weather tool's parameters schema) is
tokenized, and the matcher's mask is taken before each of its tokens: cold on a new CompiledGrammar (each
state seen for the first time: the trie walk), then warm on the same one (the memoised, packed mask). The
peer is the brute-force mask (every token's bytes fed to the state), on a sample of the same states.
Decode: 8 requests of the small preset (random weights, each vocabulary) with and without a constraint,
output tokens per second of wall time and the share of it spent in the matcher (the tool schema keeps a
random model in its strings; a required 500-character string keeps every step on a string's dense mask).
"""

import argparse
import json
import statistics
import sysconfig
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from k3 import K3Config, K3Model
from k3.formats.tokenizer import SPECIAL_TOKENS, K3Tokenizer, train_tokenizer
from k3.serve.engine import EngineConfig, LLMEngine
from k3.serve.sampling import SamplingParams
from k3.structured import CompiledGrammar, GrammarMatcher, Json, Vocabulary
from k3.train.corpus import load_corpus
from machine import cpu as cpu_name

TOOL = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country, e.g. Oslo, Norway"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "description": "Days of forecast"},
        "include_hourly": {"type": "boolean"},
        "fields": {"type": "array", "items": {"enum": ["temperature", "wind", "rain", "humidity"]}, "maxItems": 4},
        "notes": {"type": ["string", "null"], "maxLength": 200},
    },
    "required": ["location", "unit"],
}
TOOL_DOCUMENT = {
    "location": "San Francisco, California",
    "unit": "fahrenheit",
    "days": 5,
    "include_hourly": False,
    "fields": ["temperature", "rain"],
    "notes": "Planning a hike on Saturday morning; I mostly care whether it will rain before noon.",
}
OBJECT_DOCUMENT = {
    "id": "chatcmpl-9f2c",
    "user": {"name": "Ada Lovelace", "email": "ada@example.com", "roles": ["admin", "editor"], "age": 36},
    "items": [{"sku": "A-1002", "qty": 2, "price": 19.99}, {"sku": "B-77", "qty": 1, "price": 5.5e2}],
    "shipping": {"address": "12 Analytical Engine Rd, London", "express": True, "eta_days": None},
    "comment": "Please leave the parcel at the door — thanks! 🙂",
}
GRAMMARS = {"json_object": (Json({"type": "object"}), OBJECT_DOCUMENT), "tool schema": (Json(TOOL), TOOL_DOCUMENT)}


def big_tokenizer(size: int) -> K3Tokenizer:
    """A byte-level BPE with `size` tokens (the quickstart's setup, min_frequency 2): the standard library alone
    stops near 77K merges, so 80 MB of site-packages source is added."""
    texts = [d.text for d in load_corpus()[0]]
    extra = 0
    for path in sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
        try:
            texts.append(path.read_text("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        extra += len(texts[-1])
        if extra > 80e6:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=size, special_tokens=SPECIAL_TOKENS, initial_alphabet=alphabet, min_frequency=2, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return K3Tokenizer(tok)


def brute_force(compiled: CompiledGrammar, node) -> torch.Tensor:
    """The peer: every token's bytes fed to the state, no trie, no memo."""
    vocab, state = compiled.vocab, node.state
    return torch.tensor([bool(s) and state.feed_all(s) is not None for s in map(vocab.symbols, range(vocab.size))])


def mask_times(tok: K3Tokenizer, grammar: Json, document: dict, peer_states: int) -> dict:
    """Milliseconds per mask along the document's tokens: cold, warm, and the brute-force peer."""
    vocab = Vocabulary.of(tok)
    ids = tok.encode(json.dumps(document, ensure_ascii=False))
    compiled = CompiledGrammar(grammar, vocab)
    out: dict = {"tokens": len(ids)}
    out["walks"] = []  # the cold masks that walked the trie (a state met for the first time)
    for kind in ("cold", "warm"):
        matcher, times = compiled.matcher([tok.eos_id]), []
        for token in ids:
            misses, t0 = compiled.misses, time.perf_counter()
            mask = matcher.mask()
            times.append(1e3 * (time.perf_counter() - t0))
            if compiled.misses > misses:
                out["walks"].append(times[-1])
            assert mask[token], "the document is outside the grammar"
            matcher.advance(token)
        out[kind] = times
    out["states"] = compiled.misses
    matcher, nodes = compiled.matcher([tok.eos_id]), []
    for token in ids:
        nodes.append(matcher.node)
        matcher.advance(token)
    peer = []
    for node in nodes[:: max(1, len(nodes) // peer_states)][:peer_states]:
        t0 = time.perf_counter()
        want = brute_force(compiled, node)
        peer.append(1e3 * (time.perf_counter() - t0))
        assert torch.equal(want, compiled.allowed(node))
    out["peer"] = peer
    return out


LONG_STRING = Json(
    {"type": "object", "properties": {"text": {"type": "string", "minLength": 500}}, "required": ["text"]}
)


class _Timed:
    """Seconds spent in GrammarMatcher.mask and .advance while installed: the grammar's share of a step."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.originals = {name: getattr(GrammarMatcher, name) for name in ("mask", "advance")}

    def __enter__(self) -> "_Timed":
        for name, original in self.originals.items():
            setattr(GrammarMatcher, name, self._wrap(original))
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self.originals.items():
            setattr(GrammarMatcher, name, original)

    def _wrap(self, original):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def decode_speeds(tok: K3Tokenizer, constraints: dict, rounds: int = 3, n: int = 8, max_tokens: int = 64) -> dict:
    """{name: (median output tokens/s, output tokens, median share of the time in the grammar)} for n requests of the
    small preset (random weights) added at once, per constraint (None: unconstrained, eos ignored). Rounds
    alternate the constraints, so a shared machine's load hits each alike."""
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("small", vocab_size=tok.vocab_size)).eval()
    prompts = [tok.encode(f"Request {i}: the weather in Oslo as JSON:") for i in range(n)]
    engines = {}
    for name in constraints:  # one engine each, warmed up: allocators, the first forward
        engines[name] = LLMEngine(model, tok, EngineConfig(memory_budget=256 << 20, enable_prefix_caching=False))
        engines[name].add_request(prompts[0], SamplingParams(max_tokens=2))
        while engines[name].has_unfinished():
            engines[name].step()
    runs: dict = {name: [] for name in constraints}
    for _ in range(rounds):
        for name, grammar in constraints.items():
            engine = engines[name]
            params = SamplingParams(
                temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=grammar is None, grammar=grammar
            )
            for p in prompts:
                engine.add_request(p, params)
            tokens, t0 = 0, time.perf_counter()
            with _Timed() as grammar_time:
                while engine.has_unfinished():
                    tokens += sum(len(o.new_token_ids) for o in engine.step())
            seconds = time.perf_counter() - t0
            runs[name].append((tokens / seconds, tokens, grammar_time.seconds / seconds))
    return {
        name: (statistics.median(r[0] for r in results), results[0][1], statistics.median(r[2] for r in results))
        for name, results in runs.items()
    }


def quantiles(ms: list[float]) -> str:
    ms = sorted(ms)
    return f"{statistics.median(ms):.3f} / {ms[int(0.9 * (len(ms) - 1))]:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the 8K vocabulary only")
    ap.add_argument("--peer-states", type=int, default=12, help="states the brute-force peer is timed on")
    args = ap.parse_args()
    print(f"CPU: {cpu_name()}; torch {torch.__version__}")
    t0 = time.perf_counter()
    tokenizers = {8192: train_tokenizer([d.text for d in load_corpus()[0]], 8192)}
    print(f"8K tokenizer trained in {time.perf_counter() - t0:.0f} s")
    if not args.quick:
        t0 = time.perf_counter()
        tokenizers[163840] = big_tokenizer(163840)
        print(f"164K tokenizer trained in {time.perf_counter() - t0:.0f} s")
    print(
        "\n| vocabulary | grammar | tokens | new states | cold mask ms (median / p90) | trie walk ms (mean) "
        "| warm mask ms (median / p90) | brute force ms (median) | vocabulary + trie built |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size, tok in tokenizers.items():
        t0 = time.perf_counter()
        trie = Vocabulary.of(tok).trie
        built = f"{time.perf_counter() - t0:.2f} s ({trie.num_nodes:,} trie nodes)"
        for name, (grammar, document) in GRAMMARS.items():
            r = mask_times(tok, grammar, document, args.peer_states if size < 100_000 else 3)
            print(
                f"| {tok.vocab_size:,} | {name} | {r['tokens']} | {r['states']} | {quantiles(r['cold'])} "
                f"| {statistics.mean(r['walks']):.2f} | {quantiles(r['warm'])} | {statistics.median(r['peer']):.1f} "
                f"| {built} |"
            )
    print(
        "\n| engine: small preset, 8 requests x 64 tokens | vocabulary | output tokens | tokens/s (median of 3) "
        "| time in the grammar (masks + advance, median of 3) |"
    )
    print("|---|---|---|---|---|")
    constraints = {
        "no constraint": None,
        "tool schema": GRAMMARS["tool schema"][0],
        "a 500-character string": LONG_STRING,
    }
    for tok in tokenizers.values():
        for name, (speed, tokens, share) in decode_speeds(tok, constraints).items():
            print(f"| {name} | {tok.vocab_size:,} | {tokens} | {speed:.1f} | {100 * share:.1f}% |")


if __name__ == "__main__":
    main()
