"""Fixtures of the PyTorch tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def fused_vs_unfused_determinism() -> Iterator[None]:
    """Deterministic kernels on one thread, with TF32 off, for a module that compares
    fused members with members trained alone.

    TF32 convolutions would make fused (grouped) and unfused convolutions round
    differently on GPUs that have it. warn_only: some batched kernels fusion picks on
    CUDA may have no deterministic implementation, and fused-vs-unfused comparisons do
    not need one (the bit-for-bit comparisons are of unfused runs)."""
    torch = pytest.importorskip("torch")
    from stagetree.torch import deterministic

    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    with deterministic(threads=1, warn_only=True):
        yield
    torch.backends.cudnn.allow_tf32 = tf32
