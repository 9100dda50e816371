"""A LocalExecutor never closed, with a thread still reading its events at interpreter
exit (as the engine's driver thread does), exits promptly: its exit hook and the reading
thread never both reap a worker, and no worker is restarted while the hook stops them."""

from __future__ import annotations

import textwrap
from pathlib import Path

from exit_runs import run_many

SCRIPT = textwrap.dedent(
    """
    import sys, threading, time
    from stagetree.executors import LocalExecutor
    from stagetree.work import WorkerReady
    sys.path.insert(0, {tests!r})
    from test_local_executor import Counter

    ex = LocalExecutor(Counter, 2, checkpoint_dir=sys.argv[2] + "/ckpt-" + sys.argv[1])
    ex.start()
    ready = set()
    while len(ready) < 2:
        ready |= {{e.worker for e in ex.events(timeout=30) if isinstance(e, WorkerReady)}}

    def read():
        while True:
            ex.events(timeout=0.01)

    threading.Thread(target=read, daemon=True).start()
    time.sleep(0.05)
    """
)


def test_exit_with_a_thread_reading_events_is_prompt(tmp_path: Path) -> None:
    script = tmp_path / "executor_no_close.py"
    script.write_text(SCRIPT.format(tests=str(Path(__file__).resolve().parent)))
    exits = run_many(script, 12, [str(tmp_path)], timeout=30.0)
    bad = [e for e in exits if not e.clean(0)]
    assert not bad, "\n".join(f"run {e.run}: rc={e.returncode}\n{e.stderr}" for e in bad)
