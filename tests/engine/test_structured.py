"""Structured output (engine/structured.py): every output keeps to its JSON schema, regex, choice list or
grammar; a bad spec is a ValueError naming the field; speculation with a grammar stays lossless."""

import json
import re

import jsonschema
import pytest

from engine import LLM, SamplingParams, StructuredOutputs

SCHEMAS = [
    {  # nested object, array, enum
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "kind": {"enum": ["cat", "dog"]},
            "owner": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}},
                "required": ["id"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        },
        "required": ["name", "kind", "owner", "tags"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": [1, 2, "x"]}, "minItems": 2, "maxItems": 4},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", page_size=4, num_pages=256)


def _gen(llm, spec, n=3, **kw):
    params = SamplingParams(max_tokens=80, structured_outputs=spec, **kw)
    return llm.generate([f"Example {i}:" for i in range(n)], params)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_outputs_parse_and_validate(llm, schema):
    for out in _gen(llm, StructuredOutputs(json=schema)) + _gen(
        llm, StructuredOutputs(json=json.dumps(schema)), temperature=1.0, seed=4
    ):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_regex_and_choice(llm):
    for out in _gen(llm, StructuredOutputs(json_object=True), temperature=0.7, seed=1):
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:  # a random model may write one long string: what it wrote is still a JSON prefix
            assert out.text.lstrip().startswith("{")
    for out in _gen(llm, StructuredOutputs(regex=r"[0-9]{2,4}-(ab|cd)"), temperature=1.0, seed=2):
        assert re.fullmatch(r"[0-9]{2,4}-(ab|cd)", out.text) and out.finish_reason == "stop"
    choices = ["yes", "no", 'a "quoted" answer']
    outs = _gen(llm, StructuredOutputs(choice=choices), n=8, temperature=1.0, seed=3)
    assert all(o.text in choices for o in outs)
    assert llm.allocator.num_free == llm.allocator.num_pages


def test_grammar_with_ignore_eos_ends_where_the_grammar_ends(llm):
    grammar = 'root ::= "(" digit digit? ")"\ndigit ::= [0-9]'
    out = _gen(llm, StructuredOutputs(grammar=grammar), n=1, ignore_eos=True)[0]
    assert re.fullmatch(r"\(\d\d?\)", out.text) and out.finish_reason == "stop"


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}, "json"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "grammar"),
        ({"choice": []}, "choice"),
        ({"choice": ["a", 3]}, "choice"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({}, "exactly one"),
        ({"regex": "x" * (64 * 1024 + 1)}, "regex"),
    ],
)
def test_a_bad_spec_names_its_field(llm, spec, field):
    with pytest.raises((ValueError, TypeError), match=field):
        llm.add_request("Hi", SamplingParams(structured_outputs=StructuredOutputs(**spec)))
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2))[0].finish_reason == "length"  # still serving


def test_a_spec_that_fails_to_compile_fails_alone(llm, monkeypatch):
    """Whatever xgrammar raises while compiling against the vocabulary is the request's ValueError (the
    worker refuses that request and serves on), not an error out of the worker's loop."""

    def broken(grammar):
        raise RuntimeError("out of memory in the compiler")

    monkeypatch.setattr(llm.core.grammars.compiler, "compile_grammar", broken)
    with pytest.raises(ValueError, match="structured_outputs.regex did not compile: out of memory"):
        llm.add_request("Hi", SamplingParams(structured_outputs=StructuredOutputs(regex="[a-q]{3}")))
    monkeypatch.undo()
    assert llm.generate(["Hi"], SamplingParams(max_tokens=2))[0].finish_reason == "length"


def test_outputs_from_elsewhere_advance_the_grammar(llm):
    spec = StructuredOutputs(regex="ab[0-9]+")
    seq = llm.front.make_sequence(
        "Hi", SamplingParams(max_tokens=8, structured_outputs=spec), output_ids=llm.tokenizer.encode("ab")
    )
    assert seq.grammar is not None and seq.text == "ab"
    with pytest.raises(ValueError, match="structured_outputs"):
        llm.front.make_sequence(
            "Hi", SamplingParams(max_tokens=8, structured_outputs=spec), output_ids=llm.tokenizer.encode("x")
        )


def test_logprobs_under_a_grammar_are_finite(llm):
    """Masked tokens have -inf logits; their logprobs read -9999 (vLLM's), which JSON can carry."""
    spec = StructuredOutputs(choice=["yes", "no"])
    out = _gen(llm, spec, n=1, logprobs=5)[0]
    values = [lp.logprob for entry in out.logprobs for lp in entry.values()]
    assert min(values) == -9999.0 and all(v == v and v > float("-inf") for v in values)
    assert out.text in ("yes", "no")


def test_grammars_compile_once_per_spec(llm):
    before = len(llm.core.grammars.compile_s)
    spec = {"type": "object", "properties": {"z": {"enum": [1, 2]}}, "required": ["z"]}
    for _ in range(3):
        _gen(llm, StructuredOutputs(json=spec), n=2)
    assert len(llm.core.grammars.compile_s) == before + 1
    _gen(llm, StructuredOutputs(json={**spec, "required": []}), n=1)
    assert len(llm.core.grammars.compile_s) == before + 2


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_with_a_grammar_stays_lossless(method):
    """Each drafted row is masked as the grammar stands after the drafts before it; greedy outputs equal
    those without speculation, and every output keeps to the grammar."""
    spec = {"method": method, "num_speculative_tokens": 3, **({"model": "random"} if method == "mtp" else {})}
    prompts = ["[1, 2, 1, 2, 1, 2", "[true, true, true", "Example:"]
    params = SamplingParams(max_tokens=24, structured_outputs=StructuredOutputs(json=SCHEMAS[1]))
    plain = LLM("tiny-random", page_size=4, num_pages=128).generate(prompts, params)
    llm = LLM("tiny-random", page_size=4, num_pages=128, speculative_config=spec)
    fast = llm.generate(prompts, params)
    assert [o.token_ids for o in fast] == [o.token_ids for o in plain]
    for out in fast:
        jsonschema.validate(json.loads(out.text), SCHEMAS[1])
    assert llm.allocator.num_free == llm.allocator.num_pages
