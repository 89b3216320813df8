"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, with vLLM's names."""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any

from rooflm.config import EngineConfig
from rooflm.engine.engine import LLMEngine
from rooflm.outputs import RequestOutput
from rooflm.sampling_params import SamplingParams

Message = dict[str, str]


class LLM:
    """An engine for offline batches. ``model=None`` loads the embedded default (SmolLM2-135M-Instruct).

    Keyword arguments are ``EngineConfig`` fields: load_format, dtype, device, tokenizer, max_model_len,
    kv_cache_memory, kv_cache_dtype ("auto" | "int8" | "fp8"), block_size, max_num_batched_tokens, max_num_seqs,
    enable_prefix_caching, seed, enforce_eager, attention_backend, num_gpu_blocks_override, show_progress,
    quantization ("w8a16", "w4a16", "fp8", ...; see ``rooflm.quantization.config``), tensor_parallel_size (worker
    processes started here; see docs/distributed.md: a script that uses it needs the ``if __name__ == "__main__":``
    guard of Python's spawn start method).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        fields = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(kwargs) - fields)
        if unknown:
            raise ValueError(f"LLM() got unknown option(s) {unknown}: accepted are {sorted(fields - {'model'})}")
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> "LLM":
        """Wrap an existing engine (e.g. one built around an already loaded model)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        return llm

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel workers, if any (also done at interpreter exit)."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str] | Seq[list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Seq[int] | None = None,
    ) -> list[RequestOutput]:
        """Run the prompts through continuous batching; outputs come back in the prompts' order.
        A single prompt may be a string or a list of token ids. ``priority`` (one per prompt, lower first) orders
        them under ``scheduling_policy="priority"``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"priority has {len(priority)} entries for {len(prompts)} prompts")
            params = [sp.clone(priority=p) for sp, p in zip(params, priority)]
        return self._run([(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template (as transformers' ``apply_chat_template`` does) and generate.

        ``tools`` (OpenAI's function definitions) are rendered by the template when it supports them, else by the
        generic ``<tool_call>`` fallback (``rooflm.structured.tools``); ``parse_tool_calls`` reads calls back out
        of the output, and ``forced_call_grammar`` in ``structured_outputs`` forces a valid call."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        token_lists = [self.apply_chat_template(c, add_generation_prompt, tools)  # type: ignore[arg-type]
                       for c in conversations]
        return self.generate(token_lists, sampling_params, use_tqdm)

    def apply_chat_template(self, messages: list[Message], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        from rooflm.structured import tools as tool_calls

        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"model={self.engine.model_name!r} has no chat template")
        if not messages:
            raise ValueError("messages is empty: a chat needs at least one message")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or ("content" not in m and not m.get("tool_calls")):
                raise ValueError(f"messages[{i}]={m!r:.80} is invalid: expected {{'role': ..., 'content': ...}}")
        kw: dict[str, Any] = {}
        if tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            if tool_calls.template_supports_tools(tok):
                messages = tool_calls.template_messages(messages)
                kw = {"tools": tools} if tools else {}
            else:
                messages = tool_calls.fallback_messages(messages, tools)
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _run(self, items: list[tuple[str | list[int], SamplingParams]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        # Validate everything before queueing anything, so a bad prompt leaves the engine untouched.
        from rooflm.engine.admission import SLORejectedError

        ids: list[str | None] = []
        rejected: dict[int, RequestOutput] = {}  # refused by SLO-aware admission: finished at once, no tokens
        try:
            for prompt, sp in items:
                try:
                    ids.append(engine.add_request(None, prompt, sp))
                except SLORejectedError as e:
                    rejected[len(ids)] = _rejected_output(engine, e, prompt, sp)
                    ids.append(None)
        except ValueError:
            for rid in ids:
                if rid is not None:
                    engine.abort_request(rid)
            raise
        order = {rid: i for i, rid in enumerate(ids) if rid is not None}
        results: list[RequestOutput | None] = [rejected.get(i) for i in range(len(ids))]
        bar = _progress(len(ids)) if use_tqdm and len(ids) > 1 else None
        try:
            while any(r is None for r in results):
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.finished(out)
                if not engine.has_unfinished_requests() and any(r is None for r in results):
                    raise RuntimeError("the engine stopped with requests unfinished")
        except BaseException:
            for rid in order:
                engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]


def _rejected_output(engine, e, prompt: str | list[int], sp: SamplingParams) -> RequestOutput:
    """A request refused by SLO-aware admission, as a finished output: no tokens, finish reason "rejected" and the
    reason as its stop_reason."""
    from rooflm.engine.admission import FINISH_REJECTED
    from rooflm.outputs import CompletionOutput

    text, token_ids = engine._tokenize(prompt)
    outs = [CompletionOutput(i, "", [], finish_reason=FINISH_REJECTED, stop_reason=str(e)) for i in range(sp.n)]
    return RequestOutput(e.request_id, text, token_ids, outs, finished=True)


def _progress(total: int):
    from rooflm.progress import BatchProgress

    return BatchProgress(total)
