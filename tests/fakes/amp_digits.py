"""Shared by the fused AMP tests and benchmarks: the bias-free digits MLP, a state tree's
leaves, and a count of the CUDA synchronisations of a call."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from stagetree.torch.examples import DigitsTrainer


class BiasFreeDigits(DigitsTrainer):
    """The digits MLP without biases: under vmap a linear layer's bias is added after the
    autocast product, in float32 (see docs/fusion.md), where a member alone adds it in
    the lower precision."""

    def build_model(self, c: Mapping[str, Any]) -> torch.nn.Module:
        hidden = int(c["hidden"])
        return torch.nn.Sequential(
            torch.nn.Linear(64, hidden, bias=False),
            torch.nn.ReLU(),
            torch.nn.Linear(hidden, 10, bias=False),
        )


def tensors(state: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) of a state tree, leaves in order."""
    if isinstance(state, Mapping):
        for key in state:
            yield from tensors(state[key], f"{path}.{key}")
    elif isinstance(state, (list, tuple)):
        for i, item in enumerate(state):
            yield from tensors(item, f"{path}[{i}]")
    else:
        yield path, state


def cuda_syncs(call: Callable[[], Any]) -> int:
    """How many times ``call()`` synchronises with the GPU, as
    ``torch.cuda.set_sync_debug_mode("warn")`` reports them."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)
