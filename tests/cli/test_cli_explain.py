"""Tests of ``stagetree explain`` (stagetree.cli)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from stagetree.cli import build_parser, explain, main, plan_trials
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace, TrialSpec, config_key, load_space_file

ROOT = Path(__file__).resolve().parents[2]
RESNET = ROOT / "examples" / "resnet56_space.py"

TINY = """
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace

# Two trials of 100 steps that agree on steps 0-49.
space = GridSpace({"lr": [Constant(0.1), MultiStep(0.1, [50], 0.1)]})
steps = 100
"""


def _field(out: str, label: str) -> str:
    match = re.search(rf"^{label}:\s+(\S+)$", out, re.MULTILINE)
    assert match is not None, f"no {label!r} line in:\n{out}"
    return match.group(1)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tiny_space.py"
    path.write_text(text)
    return path


def test_explain_tiny_space_exact_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", str(_write(tmp_path, TINY))]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert _field(out, "trials") == "2"
    assert _field(out, "root keys") == "1"
    assert _field(out, "total steps") == "200"
    assert _field(out, "unique steps") == "150"
    assert _field(out, "merge rate") == "1.33"
    tree = out.split("stage tree:\n", 1)[1].splitlines()
    # One shared stage [0, 50), then the two trials' own stages [50, 100).
    assert tree[0].startswith(f"root {config_key({})}")
    assert re.match(r"^  node \d+ \[0, 50\) lr=0\.1  2 requests below  \(from scratch\)$", tree[1])
    assert re.match(r"^    node \d+ \[50, 100\)  1 request below, evaluate at 100$", tree[2])
    assert re.match(
        r"^    node \d+ \[50, 100\) lr=0\.01  1 request below, evaluate at 100$", tree[3]
    )
    assert len(tree) == 4


def test_explain_steps_override(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # With 40 steps the two learning rates never differ: one trial's worth of work.
    assert main(["explain", str(_write(tmp_path, TINY)), "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert _field(out, "total steps") == "80"
    assert _field(out, "unique steps") == "40"
    assert _field(out, "merge rate") == "2.00"


def test_explain_counts_fixed_configs_as_root_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = TINY.replace("steps = 100", "") + (
        "space = GridSpace({'lr': [Constant(0.1), MultiStep(0.1, [50], 0.1)]},"
        " fixed={'opt': ['sgd', 'adam']})\n"
        "def steps(trial):\n    return 100 if trial.config['opt'] == 'sgd' else 60\n"
    )
    assert main(["explain", str(_write(tmp_path, text))]) == 0
    out = capsys.readouterr().out
    assert _field(out, "trials") == "4"
    assert _field(out, "root keys") == "2"
    assert _field(out, "total steps") == str(2 * 100 + 2 * 60)
    assert _field(out, "unique steps") == str(150 + 70)
    assert _field(out, "merge rate") == f"{320 / 220:.2f}"
    assert "opt=sgd" in out and "opt=adam" in out


def test_explain_random_space_with_overrides(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (
        "from stagetree.distributions import Choice\n"
        "from stagetree.hp import MultiStep\n"
        "from stagetree.space import RandomSpace\n"
        "space = RandomSpace({'lr': MultiStep(0.1, Choice([[10], [20]]),\n"
        "                                     Choice([0.1, 0.2, 0.3, 0.4]))})\n"
        "num_trials = 3\nsteps = 30\n"
    )
    path = _write(tmp_path, text)
    assert main(["explain", str(path), "--num-trials", "8", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    # 8 distinct trials: the whole space (a random space draws distinct trials).
    assert _field(out, "trials") == "8"
    assert _field(out, "total steps") == "240"
    # All share steps 0-9, those with milestone 20 steps 10-19 too:
    # 10 + 4 x 20 (milestone 10) + 10 + 4 x 10 (milestone 20).
    assert _field(out, "unique steps") == "140"
    assert _field(out, "merge rate") == "1.71"
    # The space holds no 9th trial: said, not silently merged.
    assert main(["explain", str(path), "--num-trials", "9"]) == 2
    assert "only 8 distinct trials" in capsys.readouterr().err


def test_explain_overrides_what_the_file_does_not_define(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A file with neither steps nor num_trials nor an int seed: the options stand in.
    text = (
        "from stagetree.distributions import Choice\n"
        "from stagetree.hp import MultiStep\n"
        "from stagetree.space import RandomSpace\n"
        "space = RandomSpace({'lr': MultiStep(0.1, Choice([[10], [20]]),\n"
        "                                     Choice([0.1, 0.2, 0.3, 0.4]))})\n"
        "seed = 'not a seed'\n"
    )
    path = _write(tmp_path, text)
    args = ["explain", str(path), "--steps", "30", "--num-trials", "8", "--seed", "5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert _field(out, "trials") == "8"
    assert _field(out, "total steps") == "240"
    assert _field(out, "unique steps") == "140"
    # Without --steps the error says what to do.
    assert main(["explain", str(path), "--num-trials", "8", "--seed", "5"]) == 2
    err = capsys.readouterr().err
    assert "defines no variable 'steps'" in err and "--steps" in err


def test_explain_training_script_with_steps_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # examples/digits.py is a training script: it defines `space` but not `steps`.
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("STAGETREE_STORAGE", f"sqlite:///{tmp_path / 'digits.db'}")
    assert main(["explain", str(ROOT / "examples" / "digits.py"), "--steps", "24"]) == 0
    out = capsys.readouterr().out
    assert _field(out, "trials") == "16"
    assert _field(out, "root keys") == "1"
    assert _field(out, "total steps") == str(16 * 24)
    assert 24 <= int(_field(out, "unique steps")) < 16 * 24


def test_explain_identical_trials_count_twice() -> None:
    trial = TrialSpec({}, {"lr": Constant(0.1)})
    result = plan_trials([trial, trial], 10)
    assert result.summary.trials == 2
    assert result.summary.total_steps == 20
    assert result.summary.unique_steps == 10
    requests = result.storage.requests()
    assert [(r.refcount, r.step) for r in requests] == [(2, 10)]


def test_explain_max_lines_collapses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(_write(tmp_path, TINY)), "--max-lines", "2"]) == 0
    tree = capsys.readouterr().out.split("stage tree:\n", 1)[1].splitlines()
    assert len(tree) == 3
    assert tree[-1] == "... 2 more lines"


def test_explain_rich_table() -> None:
    buf = io.StringIO()
    space_file = load_space_file(RESNET)
    explain(space_file, out=buf, rich_output=True, max_lines=3)
    out = buf.getvalue()
    assert re.search(r"│ merge rate\s+│\s+1\.42 │", out)
    assert "... " in out and "more lines" in out


def test_explain_resnet56(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(RESNET)]) == 0
    out = capsys.readouterr().out
    assert _field(out, "trials") == str(5 * 2 * 2 * 2 * 3) == "120"
    assert _field(out, "root keys") == "6"
    assert _field(out, "total steps") == str(120 * 120)
    unique = int(_field(out, "unique steps"))
    rate = float(_field(out, "merge rate"))
    assert rate > 1.0
    assert rate == pytest.approx(14400 / unique, abs=0.005)
    # Independent count: distinct (fixed config, value prefix) pairs are unique steps.
    trials = load_space_file(RESNET).trials()
    prefixes = set()
    for t in trials:
        values = list(zip(*(t.hp[n].values(0, 120) for n in sorted(t.hp))))
        key = config_key(t.config)
        prefixes.update((key, tuple(values[: s + 1])) for s in range(120))
    assert unique == len(prefixes)
    lines = out.split("stage tree:\n", 1)[1].splitlines()
    assert len(lines) == 61 and lines[-1].endswith("more lines")


def test_explain_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["explain", str(tmp_path / "missing.py")]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1
    assert "does not exist" in err and "Traceback" not in err

    assert main(["explain", str(_write(tmp_path, "steps = 10\n"))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "defines no variable 'space'" in err

    bad = "from stagetree.space import GridSpace\nspace = GridSpace({'lr': []})\nsteps = 5\n"
    assert main(["explain", str(_write(tmp_path, bad))]) == 2
    assert "'lr' has no options" in capsys.readouterr().err


def test_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["explain"]) == 2
    assert main(["explain", "x.py", "--max-lines", "0"]) == 2
    assert main(["nope"]) == 2
    assert "usage: stagetree" in capsys.readouterr().err
    assert main(["--help"]) == 0
    assert "explain" in capsys.readouterr().out


def test_parser_has_explain() -> None:
    args = build_parser().parse_args(["explain", "s.py", "--steps", "7"])
    assert (args.command, args.space, args.steps, args.max_lines) == ("explain", "s.py", 7, 60)


def test_console_script_subprocess() -> None:
    script = Path(sys.executable).parent / "stagetree"
    if not script.exists():
        pytest.skip("the stagetree console script is not installed in this environment")
    proc = subprocess.run(
        [str(script), "explain", str(RESNET), "--max-lines", "5"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert _field(proc.stdout, "trials") == "120"
    assert float(_field(proc.stdout, "merge rate")) > 1.0
    missing = subprocess.run(
        [str(script), "explain", "no_such_space.py"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert missing.returncode == 2
    assert missing.stderr.count("\n") == 1 and "Traceback" not in missing.stderr


def test_multistep_and_constant_share_in_plan() -> None:
    # Sanity check of the semantics explain relies on (DESIGN.md rule 1).
    space = GridSpace({"lr": [Constant(0.1), MultiStep(0.1, [100], 0.1)]})
    result = plan_trials(space.trials(), 100)
    assert result.summary.unique_steps == 100


# The Hippo paper's example space (its Fig. 10), typed as written there: the batch size
# as an int constant beside a MultiStep whose numbers are floats. Two learning-rate
# schedules from 0.1 that part after step 0; 60 epochs.
FIG10 = """
from stagetree.hp import Constant, Cosine, Exponential, MultiStep
from stagetree.space import GridSpace

space = GridSpace(
    {
        "lr": [Cosine(0.1, 60), Exponential(0.1, 0.95)],
        "batch_size": [Constant(128), MultiStep(128, [40], 2)],
    }
)
steps = 60
"""


def test_explain_fig10_space_shares_equal_numbers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 25: 128 and 128.0 are one value, so each schedule's two batch sizes share
    # their first 40 epochs: 240 / 159 = 1.509 (1.008 when 128 and 128.0 differed).
    assert main(["explain", str(_write(tmp_path, FIG10))]) == 0
    out = capsys.readouterr().out
    assert _field(out, "total steps") == "240"
    assert _field(out, "unique steps") == "159"
    assert _field(out, "merge rate") == "1.51"
    result = explain(load_space_file(_write(tmp_path, FIG10)), out=io.StringIO())
    assert round(result.summary.merge_rate, 3) == 1.509
    assert "missed shares" not in out


NEAR = """
from stagetree.hp import Constant, MultiStep
from stagetree.space import GridSpace

space = GridSpace({"lr": [Constant(0.1), MultiStep(0.1000000001, [50], 0.1), Constant(0.2)]})
steps = 100
"""


def test_explain_points_out_close_values(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["explain", str(_write(tmp_path, NEAR))]) == 0
    out = capsys.readouterr().out
    assert _field(out, "unique steps") == "300"  # nothing shared: the values differ
    section = out.split("missed shares (close values, not equal):\n", 1)[1]
    first = section.splitlines()[0]
    assert "lr: 0.1 and 0.1000000001" in first and "at step 0" in first
    assert "0.2" not in section.split("stage tree:")[0]  # far values are not pointed out
