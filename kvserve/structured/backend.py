"""StructuredOutputBackend: compiles output constraints to token-level grammars with xgrammar.

xgrammar (the library vLLM uses) turns a JSON schema, a regex or an EBNF grammar into a pushdown
automaton over the tokenizer's vocabulary; a :class:`xgrammar.GrammarMatcher` walks it one accepted token
at a time and fills a bitmask of the tokens allowed next (one bit per vocabulary entry, ``int32`` words).

One backend serves one tokenizer (one engine). The tokenizer's vocabulary is read once, on first use
(under a second for a 150k vocabulary). Compiled grammars are cached by :meth:`StructuredOutputsParams.key`
(the schema as canonical JSON, or the regex / grammar text), LRU, so a schema sent with every request is
compiled once. ``compile`` is thread-safe: the server compiles off the event loop to answer 400 for an
invalid schema before the request reaches the engine, and the engine then finds it in the cache.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from kvserve.errors import InvalidRequestError
from kvserve.structured.params import StructuredOutputsParams

# xgrammar prefixes its C++ errors with "[time] /path/file.cc:line: "; users need only the message.
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class StructuredOutputBackend:
    """xgrammar behind ``compile`` (cached) and ``matcher``.

    Args:
        hf_tokenizer: the model's transformers tokenizer (only its vocabulary is read, once).
        vocab_size: the model's logits width (may exceed the tokenizer's: padding rows are never allowed).
        eos_token_id: the token that ends a request; a finished grammar allows only it. None: the
            tokenizer's own EOS.
        cache_size: how many compiled grammars to keep.
    """

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_id: int | None, cache_size: int = 256) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size
        self._eos = eos_token_id
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, bool, bool], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self.num_compiles = 0  # cache misses that compiled (for tests and logs)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                stop = [self._eos] if self._eos is not None else None
                info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=stop)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of ``params`` (from the cache when seen before).

        Raises:
            InvalidRequestError: an invalid JSON schema, regex or grammar; ``param`` is ``params.field``.
        """
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._compile(params, key[1])
        with self._lock:
            self.num_compiles += 1
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, params: StructuredOutputsParams, text: str) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        kind = params.kind
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar", "choice": "choice",
                "json_object": "JSON"}[kind]
        try:
            if kind == "json":
                schema = json.loads(text)
                if not isinstance(schema, dict | bool):
                    raise ValueError("a JSON schema must be an object")
                return compiler.compile_json_schema(text, any_whitespace=not params.disable_any_whitespace,
                                                    strict_mode=params.strict)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "choice":
                assert params.choice is not None
                return compiler.compile_grammar(choice_grammar(params.choice))
            return compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            message = _CPP_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidRequestError(f"{params.field}: invalid {what}: {message}", param=params.field) from None

    def matcher(self, params: StructuredOutputsParams) -> xgr.GrammarMatcher:
        """A fresh matcher at the start of ``params``' grammar (one per sequence)."""
        return xgr.GrammarMatcher(self.compile(params))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly ``choices``.

    Example: ``("yes", 'say "hi"')`` -> ``root ::= "yes" | "say \\"hi\\""``. JSON string escapes are valid
    EBNF string escapes in xgrammar's syntax.
    """
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
