"""One-shot check of k3's CUDA path, then KDA timings against fla, in a few minutes on one GPU.

    python benchmarks/gpu_check.py                  # needs a CUDA device; fla's kernels for the fla rows
    python benchmarks/gpu_check.py --dry-run        # the same code on the CPU, tiny sizes, torch path only
    python benchmarks/gpu_check.py --out DIR        # also write gpu_check.json and gpu_check.md there

Checks (each against k3's float64 path on the CPU, by ‖x − ref‖ / ‖ref‖ over the output, the final
state and every gradient; the worst is reported):
  op      chunk_kda with the model's flags (in-kernel gate with A_log/dt_bias, L2 norm, beta sigmoid) and an
          initial state, per backend (fla, torch on CUDA), fp32 and bf16, equal lengths / packed sequences /
          grouped value heads;
  decode  in-place decoding of B = 4 sequences over rows of a state pool, from the layer's non-contiguous
          views; rows not named must stay untouched;
  model   the tiny model's logits and one training step's parameter gradients on CUDA, per backend;
  engine  the serving engine on CUDA: greedy tokens equal the CPU engine's (fp32); bf16 runs with fp32 states.
Then KDA chunk forward and forward+backward, k3's torch path against fla, bf16, B = 1, H = 16,
K = V = 128, T from 4K to 64K (medians of CUDA-event timings), as a table for docs/benchmarks.md.
Without a GPU it prints "not run: no GPU" and exits 0.
"""

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from k3 import K3Config, K3Model
from k3.ops.kda import chunk_kda, fused_recurrent_kda
from k3.ops.kda.backend import ENV_VAR, fla_kda, fla_version

FLAGS = dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
# ‖err‖/‖ref‖ limits: fla's kernels use tf32 for fp32 dots; bf16 inputs carry bf16 rounding
LIMITS = {("fla", torch.float32): 5e-3, ("torch", torch.float32): 1e-4}
BF16_LIMIT = 3e-2


T0 = time.monotonic()
CHECKS: list[dict] = []


def emit(row: dict) -> dict:
    """Record a check's row and print it at once: on a lent GPU whatever finished before a time limit
    must already be on the screen."""
    CHECKS.append(row)
    print(
        f"{row['check']:<7} {row['case']:<45} {row['backend']:<6} {row['dtype']:<9} err {row['err']:.2e} "
        f"{'ok' if row['ok'] else 'FAIL'}  ({time.monotonic() - T0:.0f} s)",
        flush=True,
    )
    return row


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def limit(backend: str, dtype: torch.dtype) -> float:
    return BF16_LIMIT if dtype == torch.bfloat16 else LIMITS[(backend, dtype)]


def op_inputs(B, T, H, K, HV, N, seed=0):
    """Pre-activation inputs as the KDA layer produces them, fp64 on the CPU: q, k, v, g, beta, A_log,
    dt_bias, h0."""
    gen = torch.Generator().manual_seed(seed)
    HV = HV or H
    r = lambda *s, scale=1.0: torch.randn(*s, generator=gen, dtype=torch.float64) * scale  # noqa: E731
    return [
        r(B, T, H, K),
        r(B, T, H, K),
        r(B, T, HV, K),
        r(B, T, HV, K),
        r(B, T, HV),
        r(HV, scale=0.5),
        r(HV * K),
        r(N, HV, K, K, scale=0.1),
    ]


def run_op(inputs, backend, cu):
    """Forward and backward of chunk_kda; returns [o, final state, *grads]."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    q, k, v, g, beta, A_log, dt_bias, h0 = leaves
    o, S = chunk_kda(
        q,
        k,
        v,
        g,
        beta,
        initial_state=h0,
        output_final_state=True,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=cu,
        backend=backend,
        **FLAGS,
    )
    gen = torch.Generator().manual_seed(9)
    cot_o = torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device, o.dtype)
    cot_S = torch.randn(S.shape, generator=gen, dtype=torch.float64).to(S.device, S.dtype)
    ((o * cot_o).sum() + (S * cot_S).sum()).backward()
    return [o, S, *(x.grad for x in leaves)]


def check_op(device, backends, dtypes, sizes) -> None:
    for name, B, T, H, HV, cu in sizes:
        N = B if cu is None else len(cu) - 1
        cpu = op_inputs(B, T, H, 128 if device == "cuda" else 16, HV, N)
        ref = run_op(cpu, "torch", None if cu is None else torch.tensor(cu))
        for dtype in dtypes:
            for backend in backends:
                # activations in `dtype`; the gate's parameters and the state stay fp32, as in the model
                dev = [x.to(device, dtype if i < 5 else torch.float32) for i, x in enumerate(cpu)]
                got = run_op(dev, backend, None if cu is None else torch.tensor(cu, device=device))
                err = max(rel(a, b) for a, b in zip(got, ref, strict=True))
                emit(
                    dict(
                        check="op",
                        case=f"{name} T={T}",
                        backend=backend,
                        dtype=str(dtype)[6:],
                        err=err,
                        limit=limit(backend, dtype),
                        ok=err < limit(backend, dtype),
                    )
                )


def check_decode(device, backends) -> None:
    B, T, H, K = 4, 16, 4, 128 if device == "cuda" else 16
    q, k, v, g, beta, A_log, dt_bias, h0 = op_inputs(B, T, H, K, None, B, seed=3)
    ref_o, ref_S = chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, A_log=A_log, dt_bias=dt_bias, **FLAGS
    )
    for backend in backends:
        qkv = torch.cat([x.reshape(B, T, H * K) for x in (q, k, v)], dim=-1).float().to(device)
        q1, k1, v1 = (x.reshape(B, T, H, K) for x in qkv.split(H * K, dim=-1))  # views, as the layer has them
        g1, b1, A1, d1 = (x.float().to(device) for x in (g, beta, A_log, dt_bias))
        pool = torch.randn(9, H, K, K, device=device)
        idx = torch.tensor([7, 2, 0, 5], device=device)
        pool[idx] = h0.float().to(device)
        before = pool.clone()
        outs = []
        with torch.no_grad():
            for t in range(T):
                step = [x[:, t : t + 1] for x in (q1, k1, v1, g1, b1)]
                o, _ = fused_recurrent_kda(
                    *step,
                    A1,
                    d1,
                    initial_state=pool,
                    ssm_state_indices=idx,
                    inplace_final_state=True,
                    backend=backend,
                    **FLAGS,
                )
                outs.append(o)
        err = max(rel(torch.cat(outs, dim=1), ref_o), rel(pool[idx], ref_S))
        others = [i for i in range(9) if i not in idx.tolist()]
        untouched = torch.equal(pool[others], before[others])
        emit(
            dict(
                check="decode",
                case=f"B={B} pool rows, {T} steps",
                backend=backend,
                dtype="float32",
                err=err,
                limit=5e-3,
                ok=err < 5e-3 and untouched,
            )
        )


def tiny_model(vocab: int) -> K3Model:
    torch.manual_seed(0)
    model = K3Model(K3Config.from_preset("tiny", vocab_size=vocab)).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_res_proj" in name:
                p.normal_(std=0.5)
    return model


def check_model(device, backends) -> None:
    ref_model = tiny_model(512)
    tokens = torch.randint(0, 512, (2, 150), generator=torch.Generator().manual_seed(1))

    def step(model, x):
        model.zero_grad()
        out = model(x, labels=x)
        out.loss.backward()
        return out.logits, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    copies = {backend: copy.deepcopy(ref_model).float().to(device) for backend in backends}
    ref_logits, ref_grads = step(ref_model, tokens)
    for backend in backends:
        os.environ[ENV_VAR] = backend
        try:
            model = copies[backend]
            logits, grads = step(model, tokens.to(device))
        finally:
            os.environ.pop(ENV_VAR)
        err_logits = rel(logits, ref_logits)
        err_grads = max(rel(grads[n], ref_grads[n]) for n in ref_grads)
        lim = limit(backend, torch.float32)
        emit(
            dict(
                check="model",
                case="tiny logits",
                backend=backend,
                dtype="float32",
                err=err_logits,
                limit=lim,
                ok=err_logits < lim,
            )
        )
        emit(
            dict(
                check="model",
                case="tiny train-step grads",
                backend=backend,
                dtype="float32",
                err=err_grads,
                limit=10 * lim,
                ok=err_grads < 10 * lim,
            )
        )


def check_engine(device) -> None:
    from k3.formats.tokenizer import byte_tokenizer
    from k3.serve.engine import EngineConfig, LLMEngine
    from k3.serve.sampling import SamplingParams

    tok = byte_tokenizer()
    model = tiny_model(tok.vocab_size).float().eval()
    with torch.no_grad():  # logits far apart, so that fp32 rounding cannot flip a greedy choice
        model.lm_head.weight.mul_(30)
    prompts = [list(range(5, 5 + n)) for n in (3, 17, 40, 9, 66)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(m):
        eng = LLMEngine(m, tok, EngineConfig(num_pages=600))
        ids = [eng.add_request(p, params) for p in prompts]
        out = {i: [] for i in ids}
        while eng.has_unfinished():
            for r in eng.step():
                out[r.request_id] += r.new_token_ids
        return [out[i] for i in ids], eng.pool.kda_states().dtype

    with torch.no_grad():
        cpu_tokens, _ = run(model)
        dev_tokens, _ = run(copy.deepcopy(model).to(device))
        bf16_tokens, bf16_states = run(copy.deepcopy(model).to(device, torch.bfloat16))
    same = sum(a == b for a, b in zip(bf16_tokens, cpu_tokens, strict=True))
    emit(
        dict(
            check="engine",
            case="greedy tokens vs CPU engine",
            backend="auto",
            dtype="float32",
            err=float(dev_tokens != cpu_tokens),
            limit=0.5,
            ok=dev_tokens == cpu_tokens,
        )
    )
    emit(
        dict(
            check="engine",
            case=f"bf16 runs, states {str(bf16_states)[6:]}, {same}/{len(prompts)} same as fp32",
            backend="auto",
            dtype="bfloat16",
            err=0.0,
            limit=0.5,
            ok=bf16_states == torch.float32,
        )
    )


def bench(fn, device, repeats=10) -> float:
    """Median milliseconds of fn() (CUDA events), after a warm-up that includes compilation."""
    fn()
    if device != "cuda":
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(runs)
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        runs.append(start.elapsed_time(end))
    return statistics.median(runs)


def timings(device, backends, lengths, deadline) -> list[dict]:
    H, K = (16, 128) if device == "cuda" else (2, 16)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    rows = []
    for T in lengths:
        if time.monotonic() > deadline:
            rows.append(dict(T=T, skipped="time budget spent"))
            continue
        cpu = op_inputs(1, T, H, K, None, 1, seed=5)
        dev = [x.to(device, dtype if i < 5 else torch.float32) for i, x in enumerate(cpu)]
        row = dict(T=T)
        for backend in backends:
            leaves = [x.detach().clone().requires_grad_() for x in dev]

            def fwd(leaves=leaves, backend=backend):
                q, k, v, g, beta, A_log, dt_bias, h0 = leaves
                return chunk_kda(
                    q,
                    k,
                    v,
                    g,
                    beta,
                    initial_state=h0,
                    output_final_state=True,
                    A_log=A_log,
                    dt_bias=dt_bias,
                    backend=backend,
                    **FLAGS,
                )

            def fwd_bwd(fwd=fwd):
                o, S = fwd()
                (o.float().sum() + S.sum()).backward()

            with torch.no_grad():
                row[f"{backend} fwd ms"] = bench(fwd, device)
            row[f"{backend} fwd+bwd ms"] = bench(fwd_bwd, device)
            del leaves
        if "fla fwd ms" in row:
            row["torch/fla fwd"] = row["torch fwd ms"] / row["fla fwd ms"]
            row["torch/fla fwd+bwd"] = row["torch fwd+bwd ms"] / row["fla fwd+bwd ms"]
        rows.append(row)
        print("timing", {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown(checks, times, header) -> str:
    lines = [
        header,
        "",
        "| check | case | backend | dtype | max rel err | limit | ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in checks:
        lines.append(
            f"| {r['check']} | {r['case']} | {r['backend']} | {r['dtype']} | {r['err']:.2e} | "
            f"{r['limit']:.0e} | {'yes' if r['ok'] else '**NO**'} |"
        )
    keys = [k for k in (times[0] if times else {}) if k != "T"]
    for r in times:
        keys += [k for k in r if k not in keys and k != "T"]
    lines += ["", "| T | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for r in times:
        cells = [f"{r[k]:.2f}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
        lines.append(f"| {r['T']:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="run the same code on the CPU at tiny sizes (torch path)")
    ap.add_argument("--quick", action="store_true", help="fp32 equal-length op check and T = 4K, 16K timings only")
    ap.add_argument("--out", type=Path, help="write gpu_check.json and gpu_check.md here")
    ap.add_argument("--budget-s", type=float, default=420, help="stop starting new timings after this many seconds")
    args = ap.parse_args()
    if args.dry_run:
        device, backends = "cpu", ["torch"]
        sizes = [
            ("equal", 2, 70, 2, None, None),
            ("packed", 1, 90, 2, None, [0, 7, 40, 90]),
            ("gva", 1, 50, 2, 4, None),
        ]
        lengths = [256]
    else:
        if not torch.cuda.is_available():
            print("not run: no GPU")
            return 0
        device = "cuda"
        backends = ["torch", "fla"] if fla_kda() is not None else ["torch"]
        sizes = [
            ("equal", 2, 1000, 4, None, None),
            ("packed", 1, 2500, 4, None, [0, 300, 1000, 2500]),
            ("gva", 1, 700, 2, 4, None),
        ]
        lengths = [4096, 16384, 65536]
    dtypes = [torch.float32, torch.bfloat16]
    if args.quick:
        sizes, dtypes, lengths = sizes[:1], dtypes[:1], lengths[:2]
    name = torch.cuda.get_device_name(0) if device == "cuda" else platform.processor() or "cpu"
    header = (
        f"{datetime.date.today()}, {name}, torch {torch.__version__}, fla {fla_version()} "
        f"({'kernels' if 'fla' in backends else 'not used'}), python {platform.python_version()}"
    )
    print(header, flush=True)
    # the recurrent kernel first: it compiles fastest and carries the in-place decode contract
    for label, fn in [
        ("decode", lambda: check_decode(device, backends)),
        ("op", lambda: check_op(device, backends, dtypes, sizes)),
        ("model", lambda: check_model(device, backends)),
        ("engine", lambda: check_engine(device)),
    ]:
        try:
            fn()
        except Exception as error:  # report and go on: one broken check must not hide the others
            emit(
                dict(
                    check=label,
                    case=f"raised {type(error).__name__}: {error}"[:200],
                    backend="-",
                    dtype="-",
                    err=float("nan"),
                    limit=0.0,
                    ok=False,
                )
            )
    times = timings(device, backends, lengths, T0 + args.budget_s)
    table = markdown(CHECKS, times, header)
    print("\n" + table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        report = dict(header=header, checks=CHECKS, timings=times)
        (args.out / "gpu_check.json").write_text(json.dumps(report, indent=1))
        (args.out / "gpu_check.md").write_text(table + "\n")
    return 0 if all(r["ok"] for r in CHECKS) else 1


if __name__ == "__main__":
    sys.exit(main())
