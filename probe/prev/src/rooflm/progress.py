"""vLLM's progress bar of a batch (``LLM.generate(use_tqdm=True)``, ``bench throughput --progress``): finished
requests out of all, and the estimated input and output speeds so far, ``est. speed input: 1,234 tok/s, output:
567 tok/s``. The clock is injectable so the speeds can be checked without timing anything."""
from __future__ import annotations

import sys
import time
from typing import IO, Callable

from rooflm.outputs import RequestOutput
from rooflm.units import tok_rate


class BatchProgress:
    def __init__(self, total: int, file: IO[str] | None = None, clock: Callable[[], float] = time.monotonic,
                 **tqdm_kwargs) -> None:
        from tqdm import tqdm

        self.clock = clock
        self.start = clock()
        self.input_tokens = 0
        self.output_tokens = 0
        self.bar = tqdm(total=total, desc="Processed prompts", unit="req", file=file or sys.stderr,
                        dynamic_ncols=True, **tqdm_kwargs)

    def speeds(self) -> tuple[float, float]:
        """(input, output) tokens per second since the bar started; 0 before any time has passed."""
        elapsed = self.clock() - self.start
        if elapsed <= 0:
            return 0.0, 0.0
        return self.input_tokens / elapsed, self.output_tokens / elapsed

    def postfix(self) -> str:
        inp, out = self.speeds()
        return f"est. speed input: {tok_rate(inp)}, output: {tok_rate(out)}"

    def finished(self, out: RequestOutput) -> None:
        """Count one finished request: its prompt tokens and the tokens of all its samples."""
        self.input_tokens += len(out.prompt_token_ids)
        self.output_tokens += sum(len(c.token_ids) for c in out.outputs)
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
