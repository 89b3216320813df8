"""Launch under torchrun: two CPU ranks started by torchrun, the script's LLM(..., tensor_parallel_size=2) on rank 0
gives the tokens of one process; the other rank's LLM() call turns into the worker and ends its process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rooflm.sampling_params import SamplingParams
from test_tp_engine import PROMPTS
from tp_helpers import run

SCRIPT = textwrap.dedent("""
    import json, sys
    from rooflm import LLM, SamplingParams

    model, out, parallel = sys.argv[1], sys.argv[2], sys.argv[3]
    llm = LLM(model, dtype="float32", device="cpu", kv_cache_memory=16 * 2**20, show_progress=False,
              **{parallel: 2})
    params = SamplingParams(max_tokens=10, temperature=0)
    outs = llm.generate(json.loads(sys.argv[4]), params, use_tqdm=False)
    llm.shutdown()
    with open(out, "w") as f:  # only rank 0 gets here: the worker's LLM() ended its process
        json.dump([o.outputs[0].token_ids for o in outs], f)
""")


@pytest.mark.parametrize("parallel", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_torchrun_two_ranks_give_one_process_tokens(make_engine, tiny_checkpoint, tmp_path: Path, parallel):
    script = tmp_path / "generate.py"
    script.write_text(SCRIPT)
    out = tmp_path / "tokens.json"
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           tiny_checkpoint, str(out), parallel, json.dumps(PROMPTS)]
    # the timeout only guards against a hang; a normal run takes seconds
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = run(make_engine(model=tiny_checkpoint), PROMPTS, SamplingParams(max_tokens=10, temperature=0))
    assert json.loads(out.read_text()) == [ref[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))]
