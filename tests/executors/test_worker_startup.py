"""A worker process's start and end (issue 22, start-up): what its fork server and the
worker itself keep out of the garbage collector's way, and a fork server that ends
without tearing its interpreter down when the program that started it exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from test_local_executor import _batch, _ended, _of, _until

import stagetree
from stagetree.executors import LocalExecutor
from stagetree.executors.local import shutdown_pool
from stagetree.trainer import Trainer
from stagetree.work import MetricsReported, WorkerReady


class FrozenCount(Trainer):
    """Reports how many objects its process keeps out of the garbage collector's
    traversals (:func:`gc.get_freeze_count`)."""

    def train(self) -> None:
        pass

    def evaluate(self) -> dict[str, float]:
        import gc

        return {"frozen": float(gc.get_freeze_count())}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


@pytest.fixture(autouse=True)
def _empty_pool() -> Iterator[None]:
    shutdown_pool()
    yield
    shutdown_pool()


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_worker_keeps_what_it_imported_before_serving_out_of_collections(
    tmp_path: Path, method: str
) -> None:
    # What a worker imported before its first lease (a forked one: its server's torch)
    # is frozen: the collections of its warm-up, of training and of each release (which
    # close() waits for) do not traverse it.
    with LocalExecutor(
        FrozenCount, 1, checkpoint_dir=tmp_path, devices=[], start_method=method
    ) as ex:
        _until(ex, lambda ev: bool(_of(ev, WorkerReady)))
        ex.submit(_batch(1, 0, 1, evaluate_at=((1, 1),)))
        [metrics] = _of(_until(ex, _ended({1})), MetricsReported)
    assert metrics.metrics["frozen"] > 1000


def _run(script: Path, modules: Path, *args: str, env: Mapping[str, str] | None = None) -> str:
    """The output of ``script`` run in a fresh interpreter, with ``modules`` and this
    checkout's stagetree on PYTHONPATH: a fork server imports through it (not through
    the sys.path of the program that started it), and ``env`` added to its environment.
    Returns once the fork server, which holds the output pipes, ended too."""
    path = os.pathsep.join([str(modules), str(Path(stagetree.__file__).parents[1])])
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    ).stdout


SERVER_SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys
    from multiprocessing import forkserver
    sys.path[:0] = [{here!r}, {tests!r}]
    from stagetree.executors.local import _preload_modules, _start_forkserver
    from test_local_executor import Counter

    if __name__ == "__main__":
        # A module of the server's that registers an exit hook before the executor's
        # preloads do (the server's interpreter teardown would run it).
        _start_forkserver(["exit_marker", *_preload_modules(Counter)])
        child = multiprocessing.get_context("forkserver").Process(target=print)
        child.start()
        child.join()
        assert child.exitcode == 0
        print("SERVER", forkserver._forkserver._forkserver_pid, flush=True)
    """
)


def test_the_fork_server_ends_without_its_teardown_when_the_program_exits(
    tmp_path: Path,
) -> None:
    mark = tmp_path / "torn-down"
    (tmp_path / "exit_marker.py").write_text(
        f"import atexit\natexit.register(lambda: open({str(mark)!r}, 'w').close())\n"
    )
    script = tmp_path / "server.py"
    script.write_text(
        SERVER_SCRIPT.format(here=str(tmp_path), tests=str(Path(__file__).resolve().parent))
    )
    out = _run(script, tmp_path)
    assert "SERVER" in out
    assert not mark.exists()  # it ended before its teardown's exit hooks


TRAINER_MODULE = textwrap.dedent(
    """
    import os
    from stagetree.trainer import Trainer


    class Imports(Trainer):
        warmup_imports = ("imported_once",)

        @classmethod
        def warmup(cls):
            import imported_once  # noqa: F401

        def train(self):
            pass

        def evaluate(self):
            return {{}}

        def state_dict(self):
            return {{}}

        def load_state_dict(self, state):
            pass
    """
)

WORKERS_SCRIPT = textwrap.dedent(
    """
    import sys
    from stagetree.executors.local import LocalExecutor
    from stagetree.work import WorkerReady
    from imports_trainer import Imports

    if __name__ == "__main__":
        ex = LocalExecutor(Imports, 2, checkpoint_dir=sys.argv[1], start_method="forkserver")
        ex.start()
        ready = set()
        while len(ready) < 2:
            ready |= {{e.worker for e in ex.events(timeout=30) if isinstance(e, WorkerReady)}}
        print("WORKERS", ex.pid(0), ex.pid(1), flush=True)
        ex.close()
    """
)


def test_what_a_trainer_says_its_warmup_imports_is_imported_once_in_the_fork_server(
    tmp_path: Path,
) -> None:
    imported = tmp_path / "imported-by"
    (tmp_path / "imported_once.py").write_text(
        f"import os\nwith open({str(imported)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
    )
    (tmp_path / "imports_trainer.py").write_text(TRAINER_MODULE.format())
    script = tmp_path / "workers.py"
    script.write_text(WORKERS_SCRIPT.format())
    out = _run(script, tmp_path, str(tmp_path / "ckpt"))
    workers = {int(p) for p in out.split("WORKERS", 1)[1].split()}
    [importer] = [int(p) for p in imported.read_text().split()]  # once, for both workers
    assert importer not in workers  # by the server the workers were forked from


GC_PROBE_TRAINER = textwrap.dedent(
    """
    import gc
    import os
    from imports_trainer import Imports


    class Probe(Imports):
        warmup_imports = ("gc_probe",)

        @classmethod
        def warmup(cls):
            with open(os.environ["GC_PROBE_OUT"], "a") as f:
                f.write(f"worker {os.getpid()} {gc.isenabled()}\\n")
    """
)


@pytest.mark.parametrize("fork_driver", ["1", "0"])
def test_the_fork_server_imports_with_the_collector_off_and_its_workers_collect(
    tmp_path: Path, fork_driver: str
) -> None:
    # A fresh fork server (STAGETREE_FORK_DRIVER=0, as when the driver may not fork it)
    # imports torch, the trainer's modules and its warm-up imports with the garbage
    # collector off, as the one forked from the driver does; the workers collect again.
    out = tmp_path / "gc"
    (tmp_path / "gc_probe.py").write_text(
        "import gc, os\n"
        "with open(os.environ['GC_PROBE_OUT'], 'a') as f:\n"
        "    f.write(f'server {os.getpid()} {gc.isenabled()}\\n')\n"
    )
    (tmp_path / "imports_trainer.py").write_text(TRAINER_MODULE.format())
    (tmp_path / "probe_trainer.py").write_text(GC_PROBE_TRAINER)
    script = tmp_path / "workers.py"
    script.write_text(
        WORKERS_SCRIPT.replace(
            "from imports_trainer import Imports", "from probe_trainer import Probe as Imports"
        ).format()
    )
    env = {"GC_PROBE_OUT": str(out), "STAGETREE_FORK_DRIVER": fork_driver}
    _run(script, tmp_path, str(tmp_path / "ckpt"), env=env)
    lines = sorted(out.read_text().splitlines())
    assert [line.split()[2] for line in lines if line.startswith("server")] == ["False"]
    assert [line.split()[2] for line in lines if line.startswith("worker")] == ["True"] * 2


def test_the_fork_server_of_the_digits_trainers_imports_scikit_learn() -> None:
    pytest.importorskip("torch")
    from stagetree.executors.local import _preload_modules
    from stagetree.torch.examples import DigitsConvTrainer, DigitsTrainer

    for trainer in (DigitsTrainer, DigitsConvTrainer):
        assert {"torch._dynamo", "sklearn.datasets"} <= set(_preload_modules(trainer))
