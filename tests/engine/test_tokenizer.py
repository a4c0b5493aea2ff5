"""Chat templates come from model files: they render in a sandbox that runs nothing."""

import pytest
from tokenizers import Tokenizer, models

from engine.tokenizer import TextTokenizer

EVIL = [
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% set x = messages.append({'role': 'x'}) %}{{ messages }}",  # the immutable sandbox: no mutation
    "{{ raise_exception('bad role') }}",
]


def _tok(template):
    return TextTokenizer(Tokenizer(models.BPE()), template)


@pytest.mark.parametrize("template", EVIL)
def test_an_evil_chat_template_runs_nothing(template, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="chat template failed"):
        _tok(template.replace("MARKER", str(tmp_path / "pwned"))).apply_chat_template(messages)
    assert not (tmp_path / "pwned").exists() and messages == [{"role": "user", "content": "hi"}]


def test_templates_use_loop_controls_like_transformers():
    template = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "<{{ m.content }}>{% endfor %}"
    )
    out = _tok(template).apply_chat_template(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    )
    assert out == "<u>"


def test_streamed_text_is_the_decoded_text_and_multibyte_characters_arrive_whole():
    from engine.weights import load_model

    tok = load_model("smollm2-135m").tokenizer
    text = "héllo 😀 wörld"
    ids = tok.encode(text)
    stream = tok.stream()
    pieces = [stream.step(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids) == text
    assert " 😀" in pieces and not any("\ufffd" in p for p in pieces)  # whole, once its last byte came


LOOPING = [
    # nested loops over a list: no call in the inner body for a sandbox hook to see
    "{% set xs = range(10000)|list %}{% for a in xs %}{% for b in xs %}{% for c in xs %}"
    "{% endfor %}{% endfor %}{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(100000) %}{{ b }}{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("template", LOOPING)
def test_a_chat_template_that_runs_on_is_stopped_at_its_deadline(template):
    import sys
    import time

    messages = [{"role": "user", "content": "hi"}]
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"ran past 0.2 s \(template_timeout_s\)"):
        _tok(template).apply_chat_template(messages, timeout_s=0.2)
    assert time.monotonic() - start < 30  # stopped, not run to its end (hours)
    assert sys.gettrace() is None or "coverage" in type(sys.gettrace()).__module__  # the tracer is gone
    ok = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert _tok(ok).apply_chat_template(messages, timeout_s=0.2) == "hi"  # a quick one renders


def test_the_chat_template_is_compiled_once_and_a_broken_one_fails_every_time(monkeypatch):
    import engine.tokenizer as tk

    made = []
    sandbox = tk._sandbox
    monkeypatch.setattr(tk, "_sandbox", lambda: made.append(1) or sandbox())
    tok = _tok("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    for text in ("a", "b"):
        assert tok.apply_chat_template([{"role": "user", "content": text}]) == f"[{text}]"
    assert len(made) == 1
    broken = _tok("{% for m in messages %}")  # never closed: a syntax error, each time it is asked
    for _ in range(2):
        with pytest.raises(ValueError, match="chat template failed"):
            broken.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "expression",
    [
        "(10 ** 30000000) % 7",  # 35 s in one C call holding the GIL: no trace function stops it
        "'x' * 200000000",  # 200 MB at once
        "[0] * 100000000",
        "200000000 * 'x'",
    ],
)
def test_a_template_s_huge_power_or_repetition_is_refused_before_it_is_computed(expression):
    with pytest.raises(ValueError, match="too large"):  # refused before the operation runs
        _tok("{{ " + expression + " }}").apply_chat_template([{"role": "user", "content": "hi"}])
    fine = "{{ 2 ** 10 }} {{ 'ab' * 3 }} {{ 2.5 ** 2 }} {{ -3 ** 3 }}"
    assert _tok(fine).apply_chat_template([{"role": "user", "content": "hi"}]) == "1024 ababab 6.25 -27"
