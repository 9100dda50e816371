"""Capture, restore and encode every random number generator that shapes training.

Two kinds of generators are handled:

* the process-global ones: torch's CPU generator, every CUDA device's generator (once
  CUDA is initialized in the process), numpy's legacy global ``np.random`` state and
  python's ``random``;
* generator *objects* a trainer may hold: ``torch.Generator``, ``numpy.random.Generator``,
  ``numpy.random.RandomState`` and ``random.Random``.

States are kept raw (:class:`GlobalRngState`) while training, because swapping them is on
the hot path, and encoded only for checkpoints: the encoded form holds tensors, ints,
floats, strings, lists and dicts only, so it survives ``torch.load(weights_only=True)``
bit for bit (python's and numpy's Mersenne-Twister words become int64 tensors).
"""

from __future__ import annotations

import contextlib
import operator
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = [
    "GlobalRngState",
    "capture_global_rng",
    "decode_global_rng",
    "encode_global_rng",
    "get_rng_object_state",
    "get_rng_state",
    "is_rng_object",
    "preserve_rng",
    "restore_global_rng",
    "seed_rng",
    "set_rng_object_state",
    "set_rng_state",
]

RNG_TYPES: tuple[type, ...] = (
    torch.Generator,
    np.random.Generator,
    np.random.RandomState,
    random.Random,
)


@dataclass(frozen=True)
class GlobalRngState:
    """Raw snapshot of the process-global generators (cheap to take and to restore)."""

    python: tuple[Any, ...]
    numpy: dict[str, Any]
    cpu: torch.Tensor
    cuda: tuple[torch.Tensor, ...]


def _cuda_in_use() -> bool:
    # Reading a CUDA state initializes CUDA, which would break fork-based process pools
    # and cost GPU memory in CPU-only work; before initialization no draw has happened
    # and torch.manual_seed has queued the seed that initialization will apply.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_global_rng() -> GlobalRngState:
    """Snapshot torch (CPU and CUDA, once initialized), numpy and python generators."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if _cuda_in_use() else ()
    return GlobalRngState(
        python=random.getstate(),
        numpy=np.random.get_state(legacy=False),
        cpu=torch.get_rng_state(),
        cuda=cuda,
    )


def restore_global_rng(state: GlobalRngState) -> None:
    """Put the global generators back to ``state``.

    CUDA states are restored for as many devices as both the snapshot and this process
    have; a snapshot taken without CUDA leaves CUDA generators alone.
    """
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.cpu)
    if state.cuda and torch.cuda.is_available():
        count = min(len(state.cuda), torch.cuda.device_count())
        for device in range(count):
            torch.cuda.set_rng_state(state.cuda[device], device)


def seed_rng(seed: int) -> None:
    """Seed every global generator (torch CPU and CUDA, numpy, python) from ``seed``."""
    seed = operator.index(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if torch.accelerator.is_available():
        torch.manual_seed(seed % 2**64)  # also seeds every CUDA device
    else:
        # The same for a process without accelerators, where torch.manual_seed would
        # also queue a seed for each accelerator kind's lazy initialisation (with the
        # stack that called it: most of the cost of seeding a trainer).
        torch.default_generator.manual_seed(seed % 2**64)


# -- encoding for checkpoints -------------------------------------------------------------


def _encode_python(state: tuple[Any, ...]) -> dict[str, Any]:
    version, internal, gauss_next = state
    return {
        "version": version,
        "state": torch.tensor(internal, dtype=torch.int64),
        # A list instead of None: the contract allows no None.
        "gauss_next": [] if gauss_next is None else [gauss_next],
    }


def _decode_python(encoded: Mapping[str, Any]) -> tuple[Any, ...]:
    gauss = encoded["gauss_next"]
    internal = tuple(int(x) for x in encoded["state"].tolist())
    return (int(encoded["version"]), internal, float(gauss[0]) if gauss else None)


def _encode_array(array: np.ndarray) -> dict[str, Any]:
    array = np.ascontiguousarray(array)
    if array.dtype.kind in "iub":
        # 8-byte integers are reinterpreted (uint64 does not fit int64 by value).
        data = array.view(np.int64) if array.dtype.itemsize == 8 else array.astype(np.int64)
    elif array.dtype.kind == "f":
        data = array.astype(np.float64)
    else:
        raise TypeError(f"cannot encode a numpy array of dtype {array.dtype} in RNG state")
    return {"ndarray": torch.from_numpy(data.copy()), "dtype": array.dtype.str}


def _decode_array(encoded: Mapping[str, Any]) -> np.ndarray:
    data = encoded["ndarray"].numpy()
    dtype = np.dtype(encoded["dtype"])
    if dtype.kind in "iub" and dtype.itemsize == 8:
        return data.view(dtype).copy()
    return data.astype(dtype)


def _encode_plain(value: Any) -> Any:
    """numpy bit-generator states: dicts of ints, strings and arrays."""
    if isinstance(value, np.ndarray):
        return _encode_array(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _encode_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_encode_plain(v) for v in value]
    return value


def _decode_plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        if set(value) == {"ndarray", "dtype"}:
            return _decode_array(value)
        return {k: _decode_plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_decode_plain(v) for v in value]
    return value


def encode_global_rng(state: GlobalRngState) -> dict[str, Any]:
    """Checkpoint-safe form of a :class:`GlobalRngState` (see the module docstring)."""
    return {
        "python": _encode_python(state.python),
        "numpy": _encode_plain(state.numpy),
        "torch": state.cpu.clone(),
        "cuda": [s.clone() for s in state.cuda],
    }


def decode_global_rng(encoded: Mapping[str, Any]) -> GlobalRngState:
    """Inverse of :func:`encode_global_rng`."""
    return GlobalRngState(
        python=_decode_python(encoded["python"]),
        numpy=_decode_plain(encoded["numpy"]),
        cpu=encoded["torch"].clone(),
        cuda=tuple(s.clone() for s in encoded["cuda"]),
    )


def get_rng_state() -> dict[str, Any]:
    """Encoded state of every global generator; restore it with :func:`set_rng_state`."""
    return encode_global_rng(capture_global_rng())


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned."""
    restore_global_rng(decode_global_rng(state))


@contextlib.contextmanager
def preserve_rng() -> Iterator[None]:
    """Run a block and put every global generator back as it was before the block."""
    saved = capture_global_rng()
    try:
        yield
    finally:
        restore_global_rng(saved)


# -- generator objects ----------------------------------------------------------------------


def is_rng_object(value: object) -> bool:
    """Whether ``value`` is a generator object whose state a checkpoint must hold."""
    # SystemRandom draws from the OS and has no state to save.
    return isinstance(value, RNG_TYPES) and not isinstance(value, random.SystemRandom)


def get_rng_object_state(rng: object) -> dict[str, Any]:
    """Encoded state of a generator object (see :func:`is_rng_object`)."""
    if isinstance(rng, torch.Generator):
        return {"kind": "torch", "state": rng.get_state()}
    if isinstance(rng, np.random.Generator):
        return {"kind": "numpy", "state": _encode_plain(rng.bit_generator.state)}
    if isinstance(rng, np.random.RandomState):
        return {"kind": "numpy_legacy", "state": _encode_plain(rng.get_state(legacy=False))}
    if isinstance(rng, random.Random):
        return {"kind": "python", "state": _encode_python(rng.getstate())}
    raise TypeError(f"not a random number generator: {type(rng).__name__}")


def set_rng_object_state(rng: object, state: Mapping[str, Any]) -> None:
    """Restore what :func:`get_rng_object_state` returned into the same kind of object."""
    kind = state["kind"]
    expected = {
        "torch": torch.Generator,
        "numpy": np.random.Generator,
        "numpy_legacy": np.random.RandomState,
        "python": random.Random,
    }.get(kind)
    if expected is None or not isinstance(rng, expected):
        raise TypeError(f"RNG state of kind {kind!r} does not fit a {type(rng).__name__}")
    if isinstance(rng, torch.Generator):
        rng.set_state(state["state"].clone())
    elif isinstance(rng, np.random.Generator):
        rng.bit_generator.state = _decode_plain(state["state"])
    elif isinstance(rng, np.random.RandomState):
        rng.set_state(_decode_plain(state["state"]))
    elif isinstance(rng, random.Random):
        rng.setstate(_decode_python(state["state"]))
