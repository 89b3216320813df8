"""Structured output: constrain sampling to a JSON schema, a regular expression, a choice or a grammar.

- ``params.py``   ``StructuredOutputsParams`` (vLLM's name), validated without any grammar engine;
- ``backend.py``  the llguidance backend (imported lazily): the tokenizer view, grammar compilation with an LRU
                  cache, matchers;
- ``manager.py``  ``StructuredOutputManager``: one matcher per request, the allowed-token bitmask of each step,
                  advancing the matchers with the accepted tokens;
- ``tools.py``    tool calling: the tools' prompt section, the grammar of a forced call, parsing calls out of text.
"""
from rooflm.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
