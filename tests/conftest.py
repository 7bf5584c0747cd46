"""Shared pytest setup: no test may leave torch's thread count changed for the tests after it (a run
in-process and one in a subprocess must reduce in the same order to agree bitwise)."""

import faulthandler
import os
import signal

import pytest
import torch

# Engines built by tests run their steps eagerly unless a test asks for compile=True: compiling a graph takes
# tens of seconds per model, and the compiled step has its own tests (test_compiled_step.py). Set before any
# test starts a subprocess, which inherits it.
os.environ.setdefault("K3_COMPILE", "off")


@pytest.fixture(autouse=True)
def _torch_threads_unchanged():
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        pytest.fail(f"the test left torch.get_num_threads() at a different value than {threads}; restore it")


@pytest.fixture
def bounded():
    """For tests that run threads: a hang (a wait that never ends) ends the run after 300 s with every
    thread's traceback instead of stalling it."""
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def sigint_default():
    """For tests of Ctrl-C: SIGINT raises KeyboardInterrupt in this process for the test's duration, and child
    processes start with SIGINT's default, whatever pytest was started with. A shell starts a background command
    of a script (`pytest &`, `nohup pytest &`) with SIGINT ignored, Python then leaves it ignored, and a child
    inherits an ignored signal; a handled one is reset to its default at exec, so Python's handler here is also
    what the children need."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
