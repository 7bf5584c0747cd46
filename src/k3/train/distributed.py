"""Training on several processes with torch.distributed: the process group, per-rank logs, the launch.

`torchrun --nproc-per-node N -m k3.train ...` (or `k3 train --nproc N ...`, which runs torchrun) starts N
copies of the trainer with RANK, WORLD_SIZE, LOCAL_RANK and the rendezvous address in their environment;
`init_parallel` joins them into one process group: gloo on CPU, NCCL with one GPU per process on CUDA.

    Parallel(rank, world_size, ep, dp)   what the trainer needs to know; world_size 1 is the plain trainer
    RankLog                              rank r's messages to <run>/logs/rank_r.log; rank 0's also to the console

Every collective has the process group's timeout (K3_DIST_TIMEOUT_S, default 600 s; tests set a few seconds),
so a rank whose peer died raises instead of waiting forever.
"""

import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

TIMEOUT_ENV = "K3_DIST_TIMEOUT_S"
KILL_ENV = "K3_TEST_KILL"  # "RANK:POINT:STEP": that rank SIGKILLs itself there (fault tests; see kill_point)
DEFAULT_TIMEOUT_S = 600
DP_MODES = ("ddp", "fsdp")


class PeerFailure(RuntimeError):
    """A collective failed: another rank stopped (killed, crashed) or the network between ranks broke."""


@dataclass(frozen=True)
class Parallel:
    """This process's place among the training processes. Ranks 0 … world_size − 1 each take 1/world_size of
    every micro-batch's rows (data parallel over all ranks); the routed experts are split over groups of `ep`
    consecutive ranks (expert parallel), replicated world_size / ep times. `dp` is how the other parameters are
    kept: "ddp" (replicated, gradients all-reduced) or "fsdp" (FSDP2: sharded by rows, gathered per layer)."""

    rank: int = 0
    world_size: int = 1
    ep: int = 1
    dp: str = "ddp"
    backend: str | None = None

    def __post_init__(self) -> None:
        if self.dp not in DP_MODES:
            raise ValueError(f"--dp must be one of {', '.join(DP_MODES)}, got {self.dp!r}")
        if self.ep < 1 or self.world_size % self.ep:
            raise ValueError(
                f"--ep {self.ep} must divide the number of processes ({self.world_size}): the experts "
                f"are split over groups of --ep ranks"
            )

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """Where this rank's collectives take their tensors: its GPU under NCCL, the CPU under gloo."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    @property
    def ep_rank(self) -> int:
        return self.rank % self.ep

    def rows(self, batch: torch.Tensor) -> torch.Tensor:
        """This rank's equal share of a batch's rows (all of them in one process)."""
        if self.world_size == 1:
            return batch
        if len(batch) % self.world_size:
            raise ValueError(f"a micro-batch of {len(batch)} sequences does not split over {self.world_size} processes")
        per = len(batch) // self.world_size
        return batch[self.rank * per : (self.rank + 1) * per]

    def barrier(self) -> None:
        if self.distributed:
            collective(dist.barrier)

    def mean(self, value: float) -> float:
        """The mean of a number over all ranks (every rank must call it)."""
        if not self.distributed:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        collective(dist.all_reduce, t)
        return t.item() / self.world_size


_stopping = [False]  # set once this process is on its way out (a failed collective or SIGTERM): see stop_on_sigterm


def collective(fn, *args, **kwargs):
    """Run one torch.distributed call; a failure (a peer gone, a timeout) becomes a PeerFailure."""
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ConnectionError) as e:  # gloo and NCCL report a lost peer as RuntimeError subclasses
        _stopping[0] = True
        raise PeerFailure(f"a collective across ranks failed: another rank stopped or is unreachable ({e})") from e


def kill_point(rank: int, point: str, step: int) -> None:
    """For the fault tests: with K3_TEST_KILL=RANK:POINT:STEP in the environment, that rank dies by SIGKILL when
    it reaches POINT ("step": after the backward of step STEP, before the optimiser; "checkpoint": at the start
    of the checkpoint of step STEP, before it sends its part), as a crashed machine would."""
    if os.environ.get(KILL_ENV) == f"{rank}:{point}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


class Stopped(Exception):
    """SIGTERM: torchrun stops the other ranks when one failed (or the job is cancelled)."""


def stop_on_sigterm() -> None:
    """SIGTERM raises Stopped, once: when the process already stops (a collective failed, or an earlier SIGTERM),
    torchrun's SIGTERM, which typically follows a peer's death, must not cut short the message being printed."""

    def handler(signum, frame):
        if not _stopping[0]:
            _stopping[0] = True
            raise Stopped("stopped by SIGTERM (torchrun ends every rank when one has failed)")

    signal.signal(signal.SIGTERM, handler)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_parallel(dp: str = "ddp", ep: int = 1) -> Parallel:
    """Join torchrun's process group (once per process), or the one-process Parallel outside torchrun."""
    if not launched_by_torchrun() or int(os.environ["WORLD_SIZE"]) == 1:
        if ep != 1:
            raise ValueError(f"--ep {ep} needs {ep} processes or a multiple: run with --nproc (or under torchrun)")
        return Parallel(dp=dp)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    Parallel(rank, world, ep, dp)  # checks the values before any rendezvous
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise ValueError(
                f"local rank {local} has no GPU: this machine has {torch.cuda.device_count()}; start at "
                f"most one process per GPU (--nproc / --nproc-per-node)"
            )
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        timeout = timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)))
        dist.init_process_group(backend, timeout=timeout)
    return Parallel(rank, world, ep, dp, backend)


def shutdown(finished: bool = False) -> None:
    """Leave the process group; after a finished run, only once every rank is past its last collective
    (a rank tearing the group down while a peer's gloo threads still use it can make that peer abort)."""
    if dist.is_available() and dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


class RankLog:
    """A log function for one rank: lines go to <run>/logs/rank_R.log once `attach(run)` names the run folder
    (lines before that are kept and written then), and rank 0's are printed to the console as well."""

    def __init__(self, rank: int, console: bool | None = None):
        self.rank = rank
        self.console = rank == 0 if console is None else console
        self.pending: list[str] = []
        self.file = None

    def attach(self, run: Path) -> None:
        if self.file is not None:
            return
        (run / "logs").mkdir(parents=True, exist_ok=True)
        self.file = open(run / "logs" / f"rank_{self.rank}.log", "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self.file.write(f"--- rank {self.rank}, pid {os.getpid()}, host {socket.gethostname()}\n")
        for line in self.pending:
            self.file.write(line + "\n")
        self.pending.clear()

    def __call__(self, message: str) -> None:
        if self.console:
            print(message, flush=True)
        if self.file is None:
            self.pending.append(message)
        else:
            self.file.write(message + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The torchrun line that `k3 train --nproc N ARGS` runs: one machine, a free rendezvous port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "k3.train",
        *argv,
    ]


def launch(nproc: int, argv: list[str]) -> int:
    """Run `k3.train ARGS` on nproc processes of this machine through torchrun; its exit status."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(torchrun_command(nproc, argv), env=env)
