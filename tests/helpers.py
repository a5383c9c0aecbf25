"""Helpers shared by the model test modules."""

import torch


def one_thread_for_module():
    """One intra-op thread: on a shared, busy 2-core machine, OpenMP threads that wait for each other
    make small ops many times slower; the results do not depend on it. (Wrapped as a module-scoped
    autouse fixture by each model test module.)"""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
