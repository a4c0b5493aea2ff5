"""Structured output (vLLM's `structured_outputs`): the sampler may pick only tokens that keep the output
inside a JSON schema, any JSON object, a regex, one of a list of strings, or an EBNF grammar.

xgrammar does the work, as in vLLM and SGLang: a grammar is compiled once per spec against the model's
vocabulary (its compiler caches by spec), each constrained sequence holds a matcher that fills the token
bitmask before a step and accepts each token after it, and rolls back the drafts a speculative step
rejects. Only the worker that samples (decode or colocated) ever builds one: a prefill worker never
samples, so nothing about the grammar crosses the hand-off.
"""

from __future__ import annotations

import functools
import json
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where a worker masks logits: the server's front checks specs without it
    from torch import Tensor

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 * 1024  # a schema, regex or grammar longer than this is refused (compile time)
CACHED_GRAMMARS = 256  # compiled specs an engine keeps (least recently used dropped first)


@dataclass(frozen=True)
class StructuredOutputs:
    """One of: json (a JSON schema, as a dict or its text), json_object (any JSON object), regex, choice (a
    list of strings: the output is one of them), grammar (EBNF, xgrammar's dialect of GBNF)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self):
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of {KINDS}, got {given or 'none'}")
        if self.json_object is not False and self.json_object is not True:
            raise TypeError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        if self.json is not None and not isinstance(self.json, dict | str):
            raise TypeError(
                f"structured_outputs.json must be a JSON schema (object or text), got {self.json!r}"
            )
        for key in ("regex", "grammar"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise TypeError(f"structured_outputs.{key} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise TypeError(
                    f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}"
                )
            if not all(isinstance(c, str) and c for c in self.choice):
                raise TypeError("structured_outputs.choice must hold non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        kind, text = self.wire()
        if len(text) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured_outputs.{kind} has {len(text)} characters; at most {MAX_SPEC_CHARS}"
            )

    def wire(self) -> tuple[str, str]:
        """(kind, text): the spec as one string (a schema's or a choice list's JSON), for messages."""
        kind = next(k for k in KINDS if getattr(self, k) not in (None, False))
        value = getattr(self, kind)
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, json.dumps(list(value))
        if kind == "json" and isinstance(value, dict):
            return kind, json.dumps(value)  # key order kept: the schema's property order is the output's
        return kind, value

    @property
    def key(self) -> tuple[str, str]:
        """The spec's canonical form, what compiled grammars are cached by: a JSON schema compact, its
        keys in their order (added whitespace must not compile it again)."""
        kind, text = self.wire()
        if kind == "json":
            try:
                text = json.dumps(json.loads(text), separators=(",", ":"), ensure_ascii=False)
            except ValueError:
                pass  # not JSON: grammar_of() says so
        return kind, text

    @staticmethod
    def of_wire(kind: str, text: str) -> StructuredOutputs:
        if kind not in KINDS:
            raise ValueError(f"structured_outputs kind must be one of {KINDS}, got {kind!r}")
        if kind == "json_object":
            return StructuredOutputs(json_object=True)
        if kind == "choice":
            try:
                choice = json.loads(text)
            except ValueError as e:
                raise ValueError(f"structured_outputs.choice is not a JSON list: {e}") from e
            return StructuredOutputs(choice=choice)
        return StructuredOutputs(**{kind: text})

    def grammar_of(self):
        """The xgrammar Grammar (no vocabulary needed): ValueError naming the field if the spec is bad."""
        import xgrammar as xgr

        kind, text = self.wire()
        try:
            if kind == "json":
                return xgr.Grammar.from_json_schema(text, any_whitespace=False)
            if kind == "json_object":  # an object (xgrammar's built-in JSON grammar takes any value)
                return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return xgr.Grammar.from_regex(text)
            if kind == "choice":  # one rule of literal alternatives (EBNF strings escape as JSON's)
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)
                return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            return xgr.Grammar.from_ebnf(text)
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with its parser's message
            if "bad_alloc" in str(
                e
            ):  # C++ out of memory (a process's address-space cap): not the spec's text
                raise MemoryError(f"structured_outputs.{kind}: {e}") from e
            raise ValueError(f"structured_outputs.{kind} is not valid: {e}") from e


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
    """xgrammar's view of a vocabulary: special tokens as empty strings (a grammar never spells text with
    them), byte-level or raw pieces."""
    import xgrammar as xgr

    inner = tokenizer.tokenizer
    if inner is None:  # engine.tokenizer.NoTokenizer
        raise ValueError("structured_outputs needs a tokenizer and this model has none (no tokenizer.json)")
    vocab = ["" if tokenizer.is_special(i) else (inner.id_to_token(i) or "") for i in range(vocab_size)]
    kind = xgr.VocabType.BYTE_LEVEL if _byte_level(inner) else xgr.VocabType.RAW
    return xgr.TokenizerInfo(vocab, kind, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


class Compiler:
    """Compiles specs (their wire form) against a vocabulary given as TokenizerInfo JSON into xgrammar's
    serialized CompiledGrammar: what the HTTP server's sandbox process runs, under its time and memory
    limits, so that a worker only loads the result (Grammars.load)."""

    def __init__(self, info_json: str):
        import xgrammar as xgr

        info = xgr.TokenizerInfo.deserialize_json(info_json)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_json(self, kind: str, text: str) -> str:
        """ValueError naming the field when the spec is bad or does not compile."""
        spec = StructuredOutputs.of_wire(kind, text)
        grammar = spec.grammar_of()
        try:
            return self.compiler.compile_grammar(grammar).serialize_json()
        except Exception as e:
            if isinstance(e, MemoryError) or "bad_alloc" in str(e):
                raise MemoryError(f"structured_outputs.{kind}: {e}") from e
            raise ValueError(f"structured_outputs.{kind} did not compile: {e}") from e


class Grammars:
    """One engine's grammar compiler over its vocabulary, and the matchers of its constrained sequences."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        import xgrammar as xgr

        self.xgr, self.vocab_size = xgr, vocab_size
        self.info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.tokenizer = tokenizer
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # filled afresh for each row
        self._controls: Tensor | None = None  # token ids holding a control byte (JSON never has one raw)
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()  # by spec, least recent first
        self.compile_s: list[float] = []  # each compile's time (a spec found in the cache: none)

    def load(self, spec: StructuredOutputs, compiled_json: str) -> None:
        """Take spec's grammar as compiled elsewhere (compile_to_json, against this vocabulary), so that
        matcher() finds it: the worker then never compiles a client's spec on its step loop. A spec
        already here is not loaded again. ValueError if the grammar was compiled for another vocabulary."""
        key = spec.key
        if key in self.compiled:
            return
        try:
            self.compiled[key] = self.xgr.CompiledGrammar.deserialize_json(compiled_json, self.info)
        except Exception as e:
            raise ValueError(f"structured_outputs.{key[0]}: the compiled grammar does not load: {e}") from e
        while len(self.compiled) > CACHED_GRAMMARS:
            self.compiled.popitem(last=False)

    def matcher(self, spec: StructuredOutputs):
        """A new matcher for spec (ValueError naming the field if it does not compile)."""
        key = spec.key
        compiled = self.compiled.pop(key, None)
        if compiled is None:
            grammar, start = spec.grammar_of(), time.perf_counter()
            try:
                compiled = self.compiler.compile_grammar(grammar)
            except Exception as e:  # the request's problem, not the worker's: it fails alone
                raise ValueError(f"structured_outputs.{key[0]} did not compile: {e}") from e
            self.compile_s.append(time.perf_counter() - start)
        self.compiled[key] = compiled
        while len(self.compiled) > CACHED_GRAMMARS:
            self.compiled.popitem(last=False)
        return self.xgr.GrammarMatcher(compiled)

    def mask(self, logits: Tensor, matcher, spec: StructuredOutputs) -> bool:
        """Set the logits of tokens the matcher does not allow next to -inf (in place). False when the
        matcher allows nothing (it has terminated)."""
        if matcher.is_terminated():
            return False
        import torch

        matcher.fill_next_token_bitmask(self.bitmask)
        with torch.inference_mode():  # the model's logits are inference tensors
            # unpacked here: xgrammar's CPU kernel took 0.35 ms a row mid-JSON, this 0.18 (SmolLM2's vocab)
            allowed = _unpack(self.bitmask[0], logits.numel()).to(logits.device)
            logits.masked_fill_(~allowed, float("-inf"))
            if spec.json is not None or spec.json_object:
                # compact JSON holds no raw control character; xgrammar 0.2.9's strings with minLength
                # or maxLength let them through (its upstream fix covered only the others): bar them here
                logits[self.controls.to(logits.device)] = float("-inf")
        return True

    @property
    def controls(self) -> Tensor:
        if self._controls is None:
            import torch

            ids = [
                t
                for t in range(self.vocab_size)
                if any(b < 0x20 for b in self.tokenizer.token_bytes(t)) and not self.tokenizer.is_special(t)
            ]
            self._controls = torch.tensor(ids, dtype=torch.long)
        return self._controls


@functools.cache
def _shifts() -> Tensor:
    import torch

    return torch.arange(32, dtype=torch.int32)


def _unpack(bits: Tensor, n: int) -> Tensor:
    """xgrammar's bitmask (int32 words, bit i of word w = token 32 w + i) -> a bool per token."""
    return ((bits[:, None] >> _shifts()) & 1).flatten()[:n].bool()


def _byte_level(tokenizer) -> bool:
    from tokenizers import decoders

    return isinstance(tokenizer.decoder, decoders.ByteLevel)
