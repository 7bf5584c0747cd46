"""The distillation experiment of docs/evidence.md: specialist teachers fine-tuned per domain, merged into one
student by on-policy distillation, beside a student trained by SFT on the same mixture and a student
distilled from one generalist teacher; every model measured per domain (k3.distill.evaluate).

    python benchmarks/distillation.py --base runs/quickstart --work runs/distill [--parallel 3]

Phases, each skipped when its folder already holds a finished run (so an interrupted experiment continues):
    teacher-DOMAIN   k3 train --init-from BASE --data DOMAIN --steps T            (one per domain)
    teacher-all      k3 train --init-from BASE --data <all five joined> --steps G  (the generalist)
    student-multi    k3 distill --student BASE --teacher D=teacher-D ... --steps S
    student-general  k3 distill --student BASE --teacher all=teacher-all --steps S
    student-sft      k3 distill --student BASE --objective sft --mix <all five>=1 --steps S
Then the table: validation loss per domain (nats/token) and task accuracy of the reasoning domains, for
the base, each teacher and each student, printed as markdown and written to WORK/table.json (each model's
row is kept in WORK/eval-NAME.json, so `--table-only --only NAME` evaluations can run side by side).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from k3.data.domains import DOMAINS, REASONING_DOMAINS


def finished(run: Path, steps: int) -> bool:
    return (run / f"step_{steps:08d}" / "meta.json").exists()


def commands(a) -> list[tuple[str, list[str]]]:
    """(folder name, k3 arguments) of every run, teachers first."""
    train = [
        "train",
        "--init-from",
        a.base,
        "--batch-size",
        "4",
        "--seq-len",
        "128",
        "--lr",
        "1e-3",
        "--warmup",
        "5",
        "--eval-batches",
        "2",
        "--no-progress",
    ]
    t = str(a.teacher_steps)
    runs = [
        (f"teacher-{d}", [*train, "--data", d, "--steps", t, "--eval-every", t, "--ckpt-every", t]) for d in DOMAINS
    ]
    g = str(a.generalist_steps)
    runs.append(
        ("teacher-all", [*train, "--data", "+".join(DOMAINS), "--steps", g, "--eval-every", g, "--ckpt-every", g])
    )
    distill = [
        "distill",
        "--student",
        a.base,
        "--steps",
        str(a.student_steps),
        "--batch-size",
        "8",
        "--max-new-tokens",
        str(a.max_new_tokens),
        "--lr",
        "1e-3",
        "--warmup",
        "3",
        "--ckpt-every",
        "10",
        "--no-progress",
    ]
    work = Path(a.work)
    specialists = [x for d in DOMAINS for x in ("--teacher", f"{d}={work / f'teacher-{d}'}")]
    runs.append(("student-multi", [*distill, *specialists]))
    runs.append(("student-general", [*distill, "--teacher", f"all={work / 'teacher-all'}"]))
    runs.append(("student-sft", [*distill, "--objective", "sft", "--mix", ",".join(f"{d}=1" for d in DOMAINS)]))
    return runs


def steps_of(name: str, a) -> int:
    if name == "teacher-all":
        return a.generalist_steps
    return a.teacher_steps if name.startswith("teacher-") else a.student_steps


def run_all(a) -> None:
    """Teachers (in parallel, up to --parallel at once), then the students (likewise)."""
    work = Path(a.work)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for group in ("teacher-", "student-"):
        todo = [(n, c) for n, c in commands(a) if n.startswith(group) and not finished(work / n, steps_of(n, a))]
        running: list[tuple[str, subprocess.Popen, float]] = []
        while todo or running:
            while todo and len(running) < a.parallel:
                name, args = todo.pop(0)
                cmd = [sys.executable, "-m", "k3.cli", *args, "--out", str(work / name)]
                if any((work / name).glob("step_*/meta.json")):  # an interrupted run: continue it
                    cmd.append("--resume")
                with open(work / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
                    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
                running.append((name, proc, time.perf_counter()))
            time.sleep(2)
            for item in list(running):
                name, proc, t0 = item
                if proc.poll() is not None:
                    running.remove(item)
                    if proc.returncode != 0:
                        raise SystemExit(f"{name} failed (exit {proc.returncode}); see {work / name}.log")
                    print(f"{name}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def table(a) -> list[dict]:
    from k3.distill.evaluate import evaluate_domains

    work = Path(a.work)
    models = [
        ("base", Path(a.base)),
        *[(f"teacher-{d}", work / f"teacher-{d}") for d in DOMAINS],
        ("teacher-all", work / "teacher-all"),
        ("student-multi", work / "student-multi"),
        ("student-general", work / "student-general"),
        ("student-sft", work / "student-sft"),
    ]
    rows = []
    for name, path in models:
        if a.only and name not in a.only:
            continue
        cached = work / f"eval-{name}.json"  # one file per model: evaluations can run as separate processes
        if not cached.exists():
            t0 = time.perf_counter()
            scores = evaluate_domains(path, list(DOMAINS), max_tokens=a.eval_tokens, tasks=a.tasks)
            row = {"model": name, **{s.domain: {"val_loss": s.val_loss, "accuracy": s.accuracy} for s in scores}}
            cached.write_text(json.dumps({**row, "eval_s": time.perf_counter() - t0}))
        rows.append(json.loads(cached.read_text()))
        print(f"{name}: evaluated in {rows[-1]['eval_s']:.0f} s", file=sys.stderr)
    (work / "table.json").write_text(json.dumps(rows, indent=1))
    return rows


def markdown(rows: list[dict]) -> str:
    head = ["model", *[f"{d} loss" for d in DOMAINS], *[f"{d} acc" for d in REASONING_DOMAINS]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [
            r["model"],
            *[f"{r[d]['val_loss']:.3f}" for d in DOMAINS],
            *[f"{r[d]['accuracy']:.2f}" for d in REASONING_DOMAINS],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the run the teachers and students start from")
    p.add_argument("--work", required=True, help="the folder of every run and table.json")
    p.add_argument("--teacher-steps", type=int, default=40)
    p.add_argument("--generalist-steps", type=int, default=40)
    p.add_argument("--student-steps", type=int, default=20)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--eval-tokens", type=int, default=1024, help="validation tokens per domain")
    p.add_argument("--tasks", type=int, default=16, help="held-out tasks per reasoning domain")
    p.add_argument("--parallel", type=int, default=1, help="runs at once")
    p.add_argument("--table-only", action="store_true", help="evaluate the runs that exist; train nothing")
    p.add_argument("--only", nargs="*", help="evaluate only these models (base, teacher-DOMAIN, student-...)")
    a = p.parse_args()
    Path(a.work).mkdir(parents=True, exist_ok=True)
    if not a.table_only:
        run_all(a)
    print(markdown(table(a)))


if __name__ == "__main__":
    main()
