"""`python -m k3.train ARGS` is `k3 train ARGS`: the module torchrun starts on every rank
(`torchrun --nproc-per-node N -m k3.train --out runs/a ...`, which `k3 train --nproc N` runs for you)."""

import sys

from k3.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
