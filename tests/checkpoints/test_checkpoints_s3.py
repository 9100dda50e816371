"""Checkpoints in a bucket end to end (moto's S3 in server mode behind s3fs, worker
processes included), and bad checkpoint locations: each refused with a clear error
before anything is trained or written."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import S3Service, free_port
from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.checkpoints import CheckpointStore
from stagetree.exceptions import CheckpointError
from stagetree.hp import Constant, MultiStep

LRS = [Constant(0.05), MultiStep(0.05, [5], 0.5), MultiStep(0.05, [10], 0.5)]


def _run(study: Study, steps: int) -> list[dict[str, float]]:
    return [study.run({"seed": 3}, {"lr": lr}, steps).metrics for lr in LRS]


def _study(tmp_path: Path, db: str, checkpoint_dir: Any, **kw: Any) -> Study:
    kw.setdefault("executor", "local")
    kw.setdefault("workers", 2)
    return Study(
        "s3",
        LinearTrainer,
        storage=f"sqlite:///{tmp_path / db}",
        checkpoint_dir=checkpoint_dir,
        **kw,
    )


@pytest.mark.slow
def test_a_study_with_checkpoints_in_s3_equals_one_on_disk_and_resumes_from_them(
    tmp_path: Path, s3: S3Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGETREE_CACHE_DIR", str(tmp_path / "cache"))
    url = s3.url("run")
    with _study(tmp_path, "local.db", tmp_path / "ckpt") as study:
        local = _run(study, 20)
        local_executed = study.stats()["steps_executed"]
        local_more = _run(study, 25)
        local_state = study.state({"seed": 3}, {"lr": LRS[1]}, 20)
    with _study(tmp_path, "s3.db", url) as study:
        remote = _run(study, 20)
        executed = study.stats()["steps_executed"]
        assert executed == local_executed
        assert study._engine.store.location == url
    assert remote == local
    refs = CheckpointStore(url, cache_bytes=0).refs()
    assert refs, "checkpoints went to the bucket"
    # A second run (new engine, new worker processes) answers from the plan and resumes
    # from the bucket's checkpoints: no step is trained twice.
    with _study(tmp_path, "s3.db", url) as study:
        assert _run(study, 20) == remote
        assert study.stats()["steps_executed"] == executed
        state = study.state({"seed": 3}, {"lr": LRS[1]}, 20)
        assert state is not None and local_state is not None
        np.testing.assert_array_equal(state["w"], local_state["w"])
        assert _run(study, 25) == local_more
        assert study.stats()["steps_executed"] == executed + 3 * 5  # resumed at step 20


def test_a_checkpoint_missing_from_the_bucket_is_recomputed(
    tmp_path: Path, s3: S3Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STAGETREE_CACHE_DIR", str(tmp_path / "cache"))
    url = s3.url()
    with _study(tmp_path, "plan.db", url, executor="inline") as study:
        first = study.run({"seed": 1}, {"lr": LRS[0]}, 10).metrics
        store = study._engine.store
        assert store.refs()
        for ref in store.refs():
            if store.delete(ref) is False:
                raise AssertionError(ref)
    with _study(tmp_path, "plan.db", url, executor="inline") as study:
        longer = study.run({"seed": 1}, {"lr": LRS[0]}, 12).metrics
        assert study.stats()["steps_executed"] == 10 + 12  # from step 0 again
    with _study(tmp_path, "ref.db", tmp_path / "ref", executor="inline") as ref:
        assert ref.run({"seed": 1}, {"lr": LRS[0]}, 12).metrics == longer
    assert first  # (10 steps were trained and their checkpoint lost)


def test_a_corrupt_object_in_the_bucket_is_recomputed(
    tmp_path: Path, s3: S3Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = s3.url()
    monkeypatch.setenv("STAGETREE_CACHE_DIR", str(tmp_path / "cache1"))
    with _study(tmp_path, "plan.db", url, executor="inline") as study:
        study.run({"seed": 2}, {"lr": LRS[1]}, 10)
        executed = study.stats()["steps_executed"]
        store = study._engine.store
        for ref in store.refs():  # flip a byte in the middle of every object
            data = bytearray(store.bytes.get(ref))
            data[len(data) // 2] ^= 0xFF
            store.bytes.put(ref, [bytes(data)])
    monkeypatch.setenv("STAGETREE_CACHE_DIR", str(tmp_path / "cache2"))  # another machine
    with _study(tmp_path, "plan.db", url, executor="inline") as study:
        longer = study.run({"seed": 2}, {"lr": LRS[1]}, 15)
        assert study.stats()["steps_executed"] == executed + 15
    with _study(tmp_path, "ref.db", tmp_path / "ref", executor="inline") as ref:
        assert longer.metrics == ref.run({"seed": 2}, {"lr": LRS[1]}, 15).metrics


# ---------------------------------------------------------------------- bad locations


def test_unknown_scheme_is_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"unknown checkpoint URL scheme 'nosuch'") as info:
        _study(tmp_path, "plan.db", "nosuch://bucket/run")
    assert "s3://bucket/prefix" in str(info.value) and "memory" in str(info.value)
    with pytest.raises(CheckpointError, match="absolute path"):
        _study(tmp_path, "plan.db", "file://relative/dir")
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_a_missing_fsspec_package_says_what_to_install(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["s3fs"] = None  # as if s3fs were not installed
        sys.path.insert(0, {str(Path(__file__).parents[1] / "fakes")!r})
        from study_trainers import LinearTrainer
        from stagetree import Study
        from stagetree.exceptions import CheckpointError
        try:
            Study("s", LinearTrainer, storage="sqlite:///{tmp_path}/plan.db",
                  checkpoint_dir="s3://bucket/run")
        except CheckpointError as exc:
            print(exc)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "needs the package 's3fs'" in out.stdout
    assert "pip install s3fs" in out.stdout and "stagetree[s3]" in out.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_bucket_that_does_not_exist_fails_at_study_start(tmp_path: Path, s3: S3Service) -> None:
    study = _study(tmp_path, "plan.db", "s3://no-such-bucket/run", executor="inline")
    with pytest.raises(CheckpointError, match=r"s3://no-such-bucket/run.*bucket does not exist"):
        study.open()
    assert list(tmp_path.iterdir()) == []  # the plan was not even opened


def test_an_endpoint_nobody_listens_on_fails_at_study_start(tmp_path: Path) -> None:
    pytest.importorskip("s3fs")
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{free_port()}"},
        "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
    }
    store = CheckpointStore("s3://bucket/run", storage_options=options)
    study = _study(tmp_path, "plan.db", store, executor="inline")
    begin = time.monotonic()
    with pytest.raises(CheckpointError, match=r"s3://bucket/run is not reachable.*connect"):
        study.open()
    assert time.monotonic() - begin < 30
    assert list(tmp_path.iterdir()) == []
