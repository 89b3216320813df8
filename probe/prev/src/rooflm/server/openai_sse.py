"""Server-sent-events plumbing for the streamed OpenAI responses: the ``data:`` line encoder, the ``[DONE]``
terminator, and the StreamingResponse that aborts its engine requests however the stream ends."""
from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


_DONE = "data: [DONE]\n\n"


class _AbortingStreamingResponse(StreamingResponse):
    """However the response ends (finished, client gone, cancelled, or never started), closes its body generator
    and calls ``on_close`` (which aborts the engine requests still unfinished), now rather than whenever the garbage
    collector gets to it."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
