"""A small ASHA + TPE study on local worker processes (``python optuna_copy_run.py DIR``):
prints, as JSON, how often the driver opened Optuna's ``RDBStorage``, the copy processes
started (their exit codes once the study closed), and the trials the database holds."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any

import optuna
from study_trainers import LinearTrainer

import stagetree.tuners.optuna_bridge as bridge
from stagetree import Study
from stagetree.distributions import LogUniform
from stagetree.space import RandomSpace
from stagetree.tuners import ASHA

optuna.logging.set_verbosity(optuna.logging.WARNING)


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(root: Path) -> None:
    opened: list[int] = []
    init = optuna.storages.RDBStorage.__init__

    def spy(self: Any, *args: Any, **kwargs: Any) -> None:
        opened.append(1)  # in this process only: a forked copy's appends stay there
        init(self, *args, **kwargs)

    optuna.storages.RDBStorage.__init__ = spy  # type: ignore[method-assign]
    started: list[Any] = []
    pids: list[int] = []
    codes: list[int | None] = []
    helper = getattr(bridge, "start_helper", None)

    def start(*args: Any, **kwargs: Any) -> Any:
        process = helper(*args, **kwargs)
        started.append(process)
        if process is not None:
            pids.append(process.pid)
            close = process.close

            def closing() -> None:  # its exit code, before the object forgets it
                codes.append(process.exitcode)
                close()

            process.close = closing
        return process

    if helper is not None:  # (a version that copies in the driver has none)
        bridge.start_helper = start
    url = f"sqlite:///{root / 'plan.db'}"
    space = RandomSpace(hp={"lr": LogUniform(1e-3, 0.2)})
    tuner = ASHA(
        space,
        "score",
        min_steps=1,
        max_steps=8,
        eta=2,
        num_trials=12,
        sampler=optuna.samplers.TPESampler(seed=0, n_startup_trials=4),
    )
    with Study("c", LinearTrainer, storage=url, workers=2) as study:
        study.tune(tuner, progress=False)
        version = study.version
    optuna.storages.RDBStorage.__init__ = init  # type: ignore[method-assign]
    name = bridge.optuna_study_name("c", version, "ASHA", space)
    trials = optuna.load_study(study_name=name, storage=url).get_trials(deepcopy=False)
    print(
        json.dumps(
            {
                "opened_in_driver": len(opened),
                "copies": [None if p is None else 0 for p in started],
                "exit_codes": codes,
                "left": [pid for pid in pids if _exists(pid)],
                "alive": [p.name for p in multiprocessing.active_children()],
                "numbers": [t.number for t in trials],
                "finished": all(t.state.is_finished() for t in trials),
                "asked": len(tuner.trials),
                "reported": sum(len(t.intermediate_values) for t in trials),
            }
        )
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
