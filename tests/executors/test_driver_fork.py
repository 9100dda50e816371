"""The fork server forked from the driver process (issue 22, start-up): workers start
without a fresh interpreter importing what the driver has imported already, only where
forking the driver is safe, and the server holds nothing of the driver that matters.

Each case runs a script in a fresh interpreter: whether the driver may fork depends on
the threads of its process, which a test session's are not."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import stagetree

TRAINER_MODULE = textwrap.dedent(
    """
    import os
    import sys
    from stagetree.trainer import Trainer


    class Parent(Trainer):
        warmup_imports = ("noted",)

        def train(self):
            torch = sys.modules.get("torch")
            if torch is not None and self.config.get("matmul"):
                a = torch.ones(400, 400)
                for _ in range(3):
                    a = (a @ a) / 400  # several threads: torch's OpenMP pool
            if self.config.get("arrow"):  # the allocator whose thread the driver has
                import pyarrow

                pool = pyarrow.jemalloc_memory_pool()
                del [pyarrow.allocate_buffer(1 << 20, memory_pool=pool) for _ in range(8)][:]
            if self.config.get("child"):  # a process of the trainer's own
                import multiprocessing

                child = multiprocessing.get_context("forkserver").Process(target=os.getpid)
                child.start()
                child.join()
                self.child = child.exitcode
            self.t = getattr(self, "t", 0) + 1

        def evaluate(self):
            return {
                "ppid": float(os.getppid()),
                "child": float(getattr(self, "child", 0)),
            }

        def state_dict(self):
            return {"t": getattr(self, "t", 0)}

        def load_state_dict(self, state):
            self.t = state["t"]
    """
)

DRIVER_SCRIPT = textwrap.dedent(
    """
    import os
    import select
    import sys
    import threading
    import time
    from stagetree.executors import _driverfork
    from stagetree.executors.local import LocalExecutor
    from stagetree.hp import Constant
    from stagetree.work import BatchDone, MetricsReported, RunBatch, Segment, WorkerReady
    import noted  # the driver imports it before its workers start
    from parent_trainer import Parent

    if __name__ == "__main__":
        case = sys.argv[2]
        stop = threading.Event()
        if case == "thread":  # another thread alive: no fork of the driver
            threading.Thread(target=stop.wait, daemon=True).start()
        threads = 1
        if case == "omp":  # torch's thread pool started in the driver: no fork either
            import torch

            torch.set_num_threads(2)
            a = torch.ones(400, 400)
            for _ in range(3):
                a = a @ a / 400
            threads = 2
        if case == "arrow":  # pyarrow's jemalloc runs its background thread (a fork is safe)
            import pyarrow

            pool = pyarrow.jemalloc_memory_pool()
            del [pyarrow.allocate_buffer(1 << 20, memory_pool=pool) for _ in range(8)][:]
            names = [open(f"/proc/self/task/{t}/comm").read().strip()
                     for t in os.listdir("/proc/self/task")]
            print("JEMALLOC", int("jemalloc_bg_thd" in names), flush=True)
        if case == "server":  # the driver started multiprocessing's fork server itself
            import multiprocessing

            child = multiprocessing.get_context("forkserver").Process(target=os.getpid)
            child.start()
            child.join()
        r, w = os.pipe()  # the driver's: no server or worker may hold its write end
        ex = LocalExecutor(
            Parent, 2, checkpoint_dir=sys.argv[1], start_method="forkserver", devices=[],
            threads_per_worker=threads,
        )
        ex.prepare()
        ex.start()
        for worker in range(2):
            ex.submit(RunBatch(
                batch_id=worker + 1, worker=worker, root_key="r",
                config={
                    "matmul": case == "omp", "child": case == "server", "arrow": case == "arrow"
                },
                start_step=0, start_at=None,
                start_checkpoint=None, segments=(Segment(1, 0, 1, {"lr": Constant(0.1)}),),
                evaluate_at=((1, 1),), checkpoint_at=(),
            ))
        done, parents, codes = set(), set(), []
        deadline = time.monotonic() + 60
        while len(done) < 2 and time.monotonic() < deadline:
            for e in ex.events(timeout=1):
                if isinstance(e, BatchDone):
                    done.add(e.batch_id)
                if isinstance(e, MetricsReported):
                    parents.add(int(e.metrics["ppid"]))
                    codes.append(int(e.metrics["child"]))
        print("DONE", len(done), flush=True)
        print("SERVER", _driverfork.server_pid(), flush=True)
        print("REFUSED", _driverfork.refusal(), flush=True)
        print("PARENTS", *sorted(parents), flush=True)
        print("CODES", *codes, flush=True)
        os.close(w)
        readable = select.select([r], [], [], 10)[0]
        print("PIPE", "closed" if readable and os.read(r, 1) == b"" else "held", flush=True)
        ex.close()
    """
)


def _run(tmp_path: Path, case: str, **env: str) -> dict[str, list[str]]:
    noted = tmp_path / "imported-by"
    (tmp_path / "noted.py").write_text(
        f"import os\nwith open({str(noted)!r}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\n"
    )
    (tmp_path / "parent_trainer.py").write_text(TRAINER_MODULE)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER_SCRIPT)
    path = os.pathsep.join([str(tmp_path), str(Path(stagetree.__file__).parents[1])])
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), case],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env=dict(os.environ, PYTHONPATH=path, **env),
    ).stdout
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    lines["imported"] = noted.read_text().split()
    return lines


def test_workers_fork_from_a_server_forked_from_the_driver(tmp_path: Path) -> None:
    out = _run(tmp_path, "fork")
    assert out["DONE"] == ["2"]
    assert out["REFUSED"] == ["None"]
    [server] = out["SERVER"]
    assert out["PARENTS"] == [server]  # both workers forked by that server
    # What the driver imported (a warm-up import of the trainer) was not imported again
    # by a fresh fork server: it came with the fork.
    assert len(out["imported"]) == 1
    # The server and the workers hold none of the driver's pipes.
    assert out["PIPE"] == ["closed"]


@pytest.mark.parametrize("case", ["thread", "off"])
def test_a_driver_that_may_not_fork_falls_back_to_a_fresh_fork_server(
    tmp_path: Path, case: str
) -> None:
    # Another thread alive in the driver (its locks), or the switch: multiprocessing's
    # own fork server, a fresh interpreter that imports what the workers need.
    out = _run(
        tmp_path,
        "fork" if case == "off" else case,
        STAGETREE_FORK_DRIVER="0" if case == "off" else "",
    )
    assert out["DONE"] == ["2"]
    assert out["SERVER"] == ["None"]
    # Why, for the user (a debug log line) and the benchmarks.
    why = " ".join(out["REFUSED"])
    assert why.startswith("other Python threads alive" if case == "thread" else "$")
    assert len(out["imported"]) == 2  # the driver, and the fresh server
    assert out["PIPE"] == ["closed"]


def test_a_worker_forked_from_the_driver_starts_processes_of_its_own(tmp_path: Path) -> None:
    # The driver's own fork server (started before the workers) is not the workers':
    # a trainer that starts a forkserver process gets a server of its own.
    out = _run(tmp_path, "server")
    assert out["DONE"] == ["2"]
    assert out["SERVER"] != ["None"]
    assert out["CODES"] == ["0", "0"]


def test_a_driver_with_jemallocs_background_thread_forks(tmp_path: Path) -> None:
    # pyarrow's allocator (which importing pandas or scikit-learn loads) runs jemalloc's
    # background thread in the driver: jemalloc handles forks (its locks taken before,
    # its threads off in the child), so the driver still forks its server, and the
    # workers allocate with it.
    pyarrow = pytest.importorskip("pyarrow")
    try:
        pyarrow.jemalloc_memory_pool()
    except (NotImplementedError, pyarrow.ArrowNotImplementedError):
        pytest.skip("pyarrow built without jemalloc")
    out = _run(tmp_path, "arrow")
    if out["JEMALLOC"] != ["1"]:
        pytest.skip("jemalloc started no background thread here")
    assert out["DONE"] == ["2"]
    [server] = out["SERVER"]
    assert server != "None"
    assert out["PARENTS"] == [server]
    assert out["PIPE"] == ["closed"]


def test_a_driver_whose_torch_thread_pool_runs_does_not_fork(tmp_path: Path) -> None:
    # torch's OpenMP pool does not survive a fork: a worker forked from such a driver
    # would wait forever in its first parallel operation. The driver sees the pool's
    # threads right after forking, and the child ends instead of serving.
    pytest.importorskip("torch")
    out = _run(tmp_path, "omp")
    assert out["DONE"] == ["2"]
    assert out["SERVER"] == ["None"]
    assert " ".join(out["REFUSED"]).startswith("native threads left after a fork: ")


STUDY_SCRIPT = textwrap.dedent(
    """
    import sys
    from stagetree import Study
    from stagetree.executors import _driverfork
    from stagetree.hp import Constant, MultiStep
    from stagetree.space import GridSpace
    from stagetree.torch.examples import DigitsTrainer
    from stagetree.tuners import GridSearch

    if __name__ == "__main__":
        space = GridSpace(
            {"lr": [Constant(0.05), MultiStep(0.05, [3], 0.1)], "momentum": [Constant(0.9)]},
            fixed={"hidden": [16], "optimizer": ["momentum"], "batches_per_step": [2],
                   "seed": [3]},
        )
        with Study("s", DigitsTrainer, storage=f"sqlite:///{sys.argv[1]}", workers=2) as s:
            s.tune(GridSearch(space, "accuracy", steps=6), progress=False)
            print("SERVER", _driverfork.server_pid(), flush=True)
            for trial in sorted(s.trials(), key=lambda t: t.id):
                for step, metrics in sorted(trial.metrics.items()):
                    values = [f"{k}={v.hex()}" for k, v in sorted(metrics.items())]
                    print("M", trial.id, step, *values)
    """
)


def test_a_study_trains_bit_identical_on_workers_forked_from_the_driver(tmp_path: Path) -> None:
    # The same study with workers forked from the driver and from a fresh fork server:
    # every metric of every step the same to the bit.
    pytest.importorskip("torch")
    script = tmp_path / "study.py"
    script.write_text(STUDY_SCRIPT)
    path = str(Path(stagetree.__file__).parents[1])
    outs = {}
    for fork in ("1", "0"):
        out = subprocess.run(
            [sys.executable, str(script), str(tmp_path / f"plan{fork}.db")],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
            cwd=tmp_path,
            env=dict(os.environ, PYTHONPATH=path, STAGETREE_FORK_DRIVER=fork),
        ).stdout.splitlines()
        outs[fork] = out
    assert outs["1"][0] != "SERVER None" and outs["0"][0] == "SERVER None"
    assert outs["1"][1:] == outs["0"][1:]
    assert len(outs["1"]) > 6


STATE_TRAINER = textwrap.dedent(
    """
    import gc
    import sqlalchemy
    from stagetree.engine import pool
    from stagetree.trainer import Trainer


    class Inspect(Trainer):
        def train(self):
            self.t = getattr(self, "t", 0) + 1

        def evaluate(self):
            gc.unfreeze()  # the fork server froze what it inherited: see all of it
            engines = [o for o in gc.get_objects() if isinstance(o, sqlalchemy.engine.Engine)]
            return {
                "engines": float(len(pool.open_storages())),
                "pooled": float(sum(e.pool.checkedin() for e in engines)),
                "sql_engines": float(len(engines)),
            }

        def state_dict(self):
            return {"t": getattr(self, "t", 0)}

        def load_state_dict(self, state):
            self.t = state["t"]
    """
)

STATE_SCRIPT = textwrap.dedent(
    """
    import sys
    from stagetree.executors import _driverfork
    from stagetree.hp import Constant
    from stagetree.space import GridSpace
    from stagetree.study import Study
    from stagetree.tuners.basic import GridSearch
    from inspect_trainer import Inspect

    if __name__ == "__main__":
        space = GridSpace({"lr": [Constant(0.1)]})
        with Study("s", Inspect, storage=f"sqlite:///{sys.argv[1]}", workers=1) as s:
            s.trials()  # the storage opens before tune() forks the server
            s.tune(GridSearch(space, "engines", steps=1), progress=False)
            print("SERVER", _driverfork.server_pid(), flush=True)
            [trial] = s.trials()
            for name, value in sorted(trial.metrics[1].items()):
                print(name.upper(), int(value), flush=True)
    """
)


def test_a_worker_forked_from_the_driver_holds_none_of_its_engines(tmp_path: Path) -> None:
    # A worker forked from the driver inherits its modules: the engine registry must
    # not hand the worker the driver's engine (no driver thread there), and the
    # driver's pooled database connections are dropped, not reused, in the child.
    (tmp_path / "inspect_trainer.py").write_text(STATE_TRAINER)
    script = tmp_path / "study.py"
    script.write_text(STATE_SCRIPT)
    path = os.pathsep.join([str(tmp_path), str(Path(stagetree.__file__).parents[1])])
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "plan.db")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=path, STAGETREE_FORK_DRIVER="1"),
    ).stdout
    lines = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}
    assert lines["SERVER"] != ["None"]  # the worker was forked from the driver
    assert int(lines["SQL_ENGINES"][0]) >= 1  # it inherited the driver's storage engine
    assert lines["ENGINES"] == ["0"]
    assert lines["POOLED"] == ["0"]
