"""scripts/mutation_check.py on a toy repository: a mutant its test catches, one that survives, a stale one."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mutation_check.py"
_spec = importlib.util.spec_from_file_location("mutation_check", _SCRIPT)
mc = importlib.util.module_from_spec(_spec)
sys.modules["mutation_check"] = mc  # dataclasses look their module up by name
_spec.loader.exec_module(mc)

TOY = '''def add(a, b):
    return a + b


def unused(x):
    return x * 2
'''
TOY_TEST = '''from toy import add


def test_add():
    assert add(2, 3) == 5
'''


@pytest.fixture
def toy(tmp_path: Path) -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "toy.py").write_text(TOY)
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_toy.py").write_text(TOY_TEST)
    return tmp_path


CAUGHT = mc.Mutant("sub", "src/toy.py", "return a + b", "return a - b", ("tests/test_toy.py::test_add",), "minus")
SURVIVES = mc.Mutant("untested", "src/toy.py", "return x * 2", "return x * 3", ("tests/test_toy.py::test_add",),
                     "a function no test calls")
STALE = mc.Mutant("stale", "src/toy.py", "return a * b", "return a / b", ("tests/test_toy.py::test_add",), "gone")


def test_caught_and_survived_and_the_tree_left_unchanged(toy: Path):
    logs: list[str] = []
    results = mc.run_all([CAUGHT, SURVIVES], root=toy, timeout=120, log=logs.append)
    assert [(r.mutant.name, r.status) for r in results] == [("sub", "CAUGHT"), ("untested", "SURVIVED")]
    assert any(line.startswith("SURVIVED untested") for line in logs)
    assert (toy / "src" / "toy.py").read_text() == TOY  # only a temporary copy was ever patched


def test_main_exit_status(toy: Path, capsys):
    assert mc.main(["--no-baseline"], mutants=[CAUGHT], root=toy) == 0
    assert mc.main([], mutants=[CAUGHT, SURVIVES], root=toy) == 1
    assert "1/2 mutants caught; not caught: untested" in capsys.readouterr().out


def test_stale_snippet_is_refused_before_anything_runs(toy: Path, capsys):
    with pytest.raises(mc.StaleMutantError, match="'stale': its snippet occurs 0 times in src/toy.py"):
        mc.run_all([CAUGHT, STALE], root=toy, timeout=120, log=lambda _: None)
    twice = mc.Mutant("twice", "src/toy.py", "return", "yield", ("tests/test_toy.py::test_add",), "ambiguous")
    with pytest.raises(mc.StaleMutantError, match="occurs 2 times"):
        mc.check_snippet(toy, twice)
    assert mc.main([], mutants=[CAUGHT, STALE], root=toy) == 2
    assert "mutation check refused" in capsys.readouterr().err


def test_baseline_must_pass(toy: Path):
    (toy / "tests" / "test_toy.py").write_text(TOY_TEST.replace("== 5", "== 6"))
    with pytest.raises(RuntimeError, match="do not pass without any mutation"):
        mc.run_all([CAUGHT], root=toy, timeout=120, log=lambda _: None)


def test_project_mutants_are_current():
    """Every mutant of the project names a snippet present exactly once, and tests in existing files."""
    names = [m.name for m in mc.MUTANTS]
    assert len(names) == len(set(names))
    for m in mc.MUTANTS:
        mc.check_snippet(mc.ROOT, m)
        for test in m.tests:
            assert (mc.ROOT / test.split("::")[0]).is_file(), test
