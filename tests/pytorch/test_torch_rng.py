"""RNG capture: every generator round-trips exactly through torch.load(weights_only=True)."""

from __future__ import annotations

import io
import random
from typing import Any

import pytest

pytest.importorskip("torch")

import numpy as np
import torch

from stagetree.torch import (
    deterministic,
    get_rng_state,
    preserve_rng,
    seed_rng,
    set_rng_state,
)
from stagetree.torch.rng import get_rng_object_state, set_rng_object_state

pytestmark = pytest.mark.torch


def roundtrip(state: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def draws() -> tuple[list[float], list[float], list[float]]:
    # gauss/normal leave a cached second value behind: odd counts exercise that state.
    return (
        torch.randn(5).tolist(),
        [*np.random.normal(size=3).tolist(), np.random.random()],
        [random.gauss(0, 1), random.random()],
    )


def test_global_state_round_trips_including_cached_gaussians() -> None:
    seed_rng(12)
    draws()
    np.random.standard_normal()  # numpy now holds a cached gaussian
    random.gauss(0, 1)  # so does python
    state = roundtrip(get_rng_state())
    expected = draws()
    seed_rng(99)
    set_rng_state(state)
    assert draws() == expected


def test_seed_rng_seeds_everything() -> None:
    seed_rng(3)
    first = draws()
    draws()
    seed_rng(3)
    assert draws() == first
    seed_rng(4)
    assert draws() != first


def test_preserve_rng_puts_everything_back() -> None:
    seed_rng(5)
    with preserve_rng():
        draws()
    after = draws()
    seed_rng(5)
    assert draws() == after


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.Generator().manual_seed(1),
        lambda: np.random.default_rng(2),  # PCG64: 128-bit integers
        lambda: np.random.Generator(np.random.Philox(3)),  # uint64 arrays
        lambda: np.random.Generator(np.random.MT19937(4)),  # uint32 array
        lambda: np.random.RandomState(5),
        lambda: random.Random(6),
    ],
    ids=["torch", "pcg64", "philox", "mt19937", "randomstate", "python"],
)
def test_generator_objects_round_trip(make: Any) -> None:
    def sample(rng: Any) -> list[float]:
        if isinstance(rng, torch.Generator):
            return torch.rand(4, generator=rng).tolist()
        if isinstance(rng, random.Random):
            return [rng.gauss(0, 1), rng.random()]
        return rng.standard_normal(3).tolist()

    rng = make()
    sample(rng)
    state = roundtrip(get_rng_object_state(rng))
    expected = sample(rng)
    fresh = make()
    set_rng_object_state(fresh, state)
    assert sample(fresh) == expected


def test_generator_objects_of_another_kind_are_refused() -> None:
    state = get_rng_object_state(random.Random(1))
    with pytest.raises(TypeError, match="does not fit"):
        set_rng_object_state(np.random.default_rng(1), state)
    with pytest.raises(TypeError, match="not a random number generator"):
        get_rng_object_state(object())


def test_deterministic_applies_and_restores() -> None:
    threads = torch.get_num_threads()
    enabled = torch.are_deterministic_algorithms_enabled()
    with deterministic(threads=1):
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.get_num_threads() == 1
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == enabled
    with pytest.raises(ValueError, match="threads"):
        deterministic(threads=0)
