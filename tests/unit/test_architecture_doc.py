"""docs/architecture.md names every module of the package: its layout is where a new reader starts, so a module added
without a line there fails here. (A file name shared by several packages, such as ``cli.py``, is matched by name.)"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "rooflm"


def test_every_module_is_named_in_the_architecture_doc() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    modules = [p for p in sorted(PACKAGE.rglob("*")) if p.suffix in (".py", ".c") and "__pycache__" not in p.parts
               and p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) > 100  # the walk found the package
    missing = [str(p.relative_to(PACKAGE)) for p in modules if p.name not in doc]
    assert not missing, f"modules not named in docs/architecture.md: {missing}"
