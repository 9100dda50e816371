"""One engine of the cooperation tests (tests/engine/test_cooperation.py), run as a process.

Usage: ``python coop_script.py SPEC_JSON``, where the spec says: ``url`` (storage),
``study``, ``trials`` (``[[milestone or null, steps], ...]``: lr 0.05, halved at the
milestone), ``mode`` (``"submit"``: all trials at once; ``"tune"``: a GridSearch),
``nap`` (seconds per step), ``start`` (a file to wait for, so that processes start
at once), ``out`` (where the results go as JSON), ``workers``.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from study_trainers import LinearTrainer

from stagetree import Study
from stagetree.exceptions import StudyBusyError
from stagetree.hp import Constant, MultiStep, Sequence
from stagetree.plan import SQLPlanStorage
from stagetree.space import TrialSpec
from stagetree.tuners import GridSearch


class NapTrainer(LinearTrainer):
    """LinearTrainer whose steps take ``config["nap"]`` seconds, so engines overlap.

    With ``COOP_GATE`` set (``URL|study,study|seconds``), a worker's first step waits
    until every named study has its trials in the plan, then ``seconds`` more: every
    engine has then polled the others' branch points before a stage passes one, on a
    machine however loaded (a branch point learnt after its step was trained is
    recomputed, which is right but not what the tests that set it check).
    """

    gated = False

    def train(self) -> dict[str, float]:
        if not NapTrainer.gated:
            NapTrainer.gated = True
            wait_for_gate(os.environ.get("COOP_GATE"))
        time.sleep(float(self.config.get("nap", 0.0)))
        return super().train()


def wait_for_gate(gate: str | None) -> None:
    if not gate:
        return
    url, studies, settle = gate.split("|")
    deadline = time.monotonic() + 60
    with SQLPlanStorage(url) as plan:
        while time.monotonic() < deadline:
            if all(plan.trials(name, light=True) for name in studies.split(",")):
                break
            time.sleep(0.05)
    time.sleep(float(settle))


def lr_of(milestone: int | None) -> Sequence:
    return Constant(0.05) if milestone is None else MultiStep(0.05, [milestone], 0.5)


def main(spec: dict[str, Any]) -> int:
    if os.environ.get("COOP_DEBUG"):
        import logging

        logging.basicConfig(
            level=logging.DEBUG, format=f"{os.getpid()} %(relativeCreated)d %(message)s"
        )
    start = spec.get("start")
    if start:
        while not os.path.exists(start):
            time.sleep(0.005)
    config = {"nap": spec.get("nap", 0.05)}
    trials = [(m, int(steps)) for m, steps in spec["trials"]]
    out: dict[str, Any] = {"pid": os.getpid()}
    study = Study(
        spec["study"],
        NapTrainer,
        storage=spec["url"],
        workers=spec.get("workers", 1),
        version="coop-test",
        checkpoint_dir=spec.get("checkpoint_dir"),
    )
    code = 0
    with study:
        if spec.get("mode") == "tune":
            grid = [TrialSpec(config, {"lr": lr_of(m)}) for m, _ in trials]
            tuner = GridSearch(grid, metric="score", steps=max(s for _, s in trials))
            try:
                study.tune(tuner)
                out["outcome"] = "tuned"
            except StudyBusyError as exc:
                out["outcome"] = "busy"
                out["message"] = str(exc)
                code = 3
        else:

            async def run() -> list[Any]:
                return await asyncio.gather(
                    *(study.submit(config, {"lr": lr_of(m)}, steps) for m, steps in trials)
                )

            results = asyncio.run(run())
            out["metrics"] = {
                f"{m}:{steps}": r.metrics for (m, steps), r in zip(trials, results, strict=True)
            }
            out["outcome"] = "submitted"
        out["stats"] = study.stats()  # waits for the batches to report their end
    Path(spec["out"]).write_text(json.dumps(out))
    return code


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
