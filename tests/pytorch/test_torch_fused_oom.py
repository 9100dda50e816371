"""A fused job that runs out of device memory trains again at half its width (TreeML
§5.2, HFTA): the width that fits is found by halving, and the worker keeps it for the
plan tree, on CPU with the real ``torch.cuda.OutOfMemoryError``."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from fused_oom import FitsTwoFused  # tests/fakes, see conftest
from study_trainers import submit_together

from stagetree.hp import Piecewise
from stagetree.study import Study


def _grid(fuse: bool, rates: Sequence[float], storage: str = "memory://") -> list[dict[str, float]]:
    config = {"dropout": 0.0, "batches_per_step": 2, "hidden": 32}
    trials = [(config, {"lr": Piecewise([0.05, lr], [3])}) for lr in rates]
    study = Study("grid", FitsTwoFused, storage=storage, executor="inline", fuse=fuse)
    with study, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = submit_together(study, trials, 8)
    return [r.metrics for r in results]


def test_a_fused_job_out_of_memory_trains_again_at_half_the_width() -> None:
    FitsTwoFused.widths.clear()
    fused = _grid(True, (0.02, 0.05, 0.1, 0.2))
    # Four members ran out of memory; then two fused jobs of two, which fit.
    assert FitsTwoFused.widths == [4, 2, 2]
    exact = _grid(False, (0.02, 0.05, 0.1, 0.2))
    for got, want in zip(fused, exact):
        assert got["accuracy"] == want["accuracy"]
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)


def test_the_width_that_fits_is_kept_in_the_plan(tmp_path: Path) -> None:
    """The scheduler learns the width too, and the plan keeps it: a later run of the
    study (new trials in the same tree) fuses at most two members from the start."""
    storage = f"sqlite:///{tmp_path}/plan.db"
    FitsTwoFused.widths.clear()
    _grid(True, (0.02, 0.05, 0.1, 0.2), storage)
    assert FitsTwoFused.widths == [4, 2, 2]
    FitsTwoFused.widths.clear()
    _grid(True, (0.03, 0.04, 0.06, 0.07), storage)
    assert FitsTwoFused.widths and max(FitsTwoFused.widths) <= 2
