"""GPU tests: each module skips itself without CUDA. The shared kernel checks live in tests/kernels."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
