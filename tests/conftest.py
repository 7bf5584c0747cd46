"""Shared pytest setup: no test may leave torch's thread count changed for the tests after it (a run
in-process and one in a subprocess must reduce in the same order to agree bitwise)."""

import faulthandler

import pytest
import torch


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
