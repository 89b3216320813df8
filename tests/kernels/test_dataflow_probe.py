"""The data path of tests/gpu/dataflow_probe.py under the Triton interpreter: a small chain of the five stage shapes
run in each mode that keeps the dependency gives the plain launches' values bit for bit. In the dataflow mode the
interpreter (which runs programs one after another, so nothing can race) checks both sides of every wait: a
consumer that asks for a count its producer never reaches is counted as a miss, and a consumer reads a producer's
value only after waiting for its chunk (an earlier read is NaN and spoils the output). The timing needs a GPU:
``python3 tests/gpu/dataflow_probe.py``."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

PROBE = Path(__file__).resolve().parents[1] / "gpu" / "dataflow_probe.py"


def _probe():
    spec = importlib.util.spec_from_file_location("dataflow_probe", PROBE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_modes_give_the_plain_launches_values(capsys) -> None:
    probe = _probe()
    probe.check(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    out = capsys.readouterr().out
    for name in ("stream order", "PDL, wait", "dataflow"):
        assert f"{name}: outputs equal" in out, out


def test_counters_reach_their_programs_count() -> None:
    """After one dataflow step every stage's counters sum to its number of programs, each chunk holding at most
    ``PPC`` of them: what the consumers' waits ask for."""
    probe = _probe()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    b = probe.build(1, dev, probe.SMALL)
    bn, ppc = 16, 2
    probe.run_chain(b, probe.MODES["dataflow"], bn, 16, 2, ppc)
    for i, (n, _) in enumerate(b["shapes"]):
        progs = -(-n // bn)
        flags = b["flags"][i].cpu()
        chunks = -(-progs // ppc)
        assert int(flags.sum()) == progs, (i, flags[:chunks])
        want = torch.tensor([min(ppc, progs - c * ppc) for c in range(chunks)], dtype=flags.dtype)
        assert torch.equal(flags[:chunks], want), (i, flags[:chunks])
        assert int(flags[chunks:].abs().sum()) == 0
