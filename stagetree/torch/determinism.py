"""Settings that make PyTorch runs repeat bit for bit."""

from __future__ import annotations

import os
from types import TracebackType

import torch

__all__ = ["deterministic"]


class deterministic:  # lower case: used like a function, as torch.no_grad is
    """Make PyTorch deterministic; optionally undo it when used as a context manager.

    Applied as soon as it is called, so ``deterministic()`` on its own line is enough in a
    worker or test; ``with deterministic():`` also restores the previous settings on exit.

    It sets ``torch.use_deterministic_algorithms(True)``, the number of intra-op threads
    (one thread makes CPU reductions repeat exactly, whatever the machine's load),
    ``cudnn.deterministic = True`` and ``cudnn.benchmark = False``, and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` when unset (cuBLAS needs it before its first use
    to be deterministic).

    Args:
        threads: intra-op threads for ``torch.set_num_threads``; None leaves them alone.
        warn_only: passed to ``torch.use_deterministic_algorithms``: warn instead of
            raising when an operation has no deterministic implementation.
    """

    def __init__(self, threads: int | None = 1, *, warn_only: bool = False) -> None:
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self._previous = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.get_num_threads(),
            torch.backends.cudnn.deterministic,
            torch.backends.cudnn.benchmark,
        )
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        if threads is not None:
            torch.set_num_threads(threads)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False

    def restore(self) -> None:
        """Put back the settings that were in force before this call."""
        enabled, warn_only, threads, cudnn_deterministic, cudnn_benchmark = self._previous
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.set_num_threads(threads)
        torch.backends.cudnn.deterministic = cudnn_deterministic
        torch.backends.cudnn.benchmark = cudnn_benchmark

    def __enter__(self) -> deterministic:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.restore()
