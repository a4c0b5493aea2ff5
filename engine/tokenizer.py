"""Tokenizers: byte-level BPE rebuilt from GGUF metadata, or a Hugging Face tokenizer.json; chat templates."""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream

GGUF_CONTROL = 3  # llama.cpp token type of special (control) tokens


class TextTokenizer:
    """encode/decode plus the chat template, over a `tokenizers.Tokenizer`."""

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None = None, bos_token: str | None = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self._specials: frozenset[int] | None = None
        self._template: jinja2.Template | None = None  # the chat template, compiled at first use

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    @functools.cached_property
    def definition(self) -> bytes:
        """The whole tokenizer as tokenizer.json's text: what makes its ids mean what they mean (read
        once: a tenth of a second for a 49k-token BPE, and a built-in tokenizer serves many engines)."""
        return self.tokenizer.to_str().encode()

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a piece of a UTF-8 character, in byte-level BPE, is not text)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if isinstance(self.tokenizer.decoder, decoders.ByteLevel) and not self.is_special(token_id):
            table = _byte_level_table()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def is_special(self, token_id: int) -> bool:
        """A special (control) token: <|endoftext|>, <|im_start|>, ..."""
        if self._specials is None:
            added = self.tokenizer.get_added_tokens_decoder()
            self._specials = frozenset(i for i, t in added.items() if t.special)
        return token_id in self._specials

    def stream(self, skip_special_tokens: bool = True) -> TextStream:
        """An incremental detokenizer: feed it ids one at a time (O(1) each); a character that spans
        several tokens (an emoji in byte-level BPE) comes out whole, once its last byte arrives."""
        return TextStream(self.tokenizer, DecodeStream(skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, timeout_s: float | None = None
    ) -> str:
        """Render the model's chat template. The template comes from a model file, so it is untrusted: it runs
        in jinja2's immutable sandbox (as in transformers), and whatever it raises becomes a ValueError.
        timeout_s: a template still running after this long (nested loops) is stopped: ValueError."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass plain prompts (chat=False)")
        if self._template is None:  # compiled once (3-5 ms a chat request here when compiled each time)
            self._template = compile_template(self.chat_template)
        return render_template(self._template, messages, self.bos_token, add_generation_prompt, timeout_s)


class NoTokenizer:
    """A model folder without tokenizer.json: prompts are token ids, outputs are token ids, text is ''."""

    chat_template = None
    tokenizer = None
    definition = b""

    def __init__(self, vocab_size: int, where: Path):
        self.vocab_size, self._where = vocab_size, where

    def _refuse(self, what: str):
        return ValueError(f"{what} needs a tokenizer and {self._where} has no tokenizer.json: pass token ids")

    def encode(self, text: str) -> list[int]:
        raise self._refuse("a text prompt")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def token_bytes(self, token_id: int) -> bytes:
        return b""

    def is_special(self, token_id: int) -> bool:
        return False

    def stream(self, skip_special_tokens: bool = True) -> _Silent:
        return _Silent()

    def apply_chat_template(self, messages, add_generation_prompt=True, timeout_s=None) -> str:
        raise self._refuse("a chat")


class _Silent:
    def step(self, token_id: int) -> str:
        return ""


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stream: DecodeStream):
        self._tokenizer, self._stream = tokenizer, stream

    def step(self, token_id: int) -> str:
        """The text this token completes ('' while a character is still partial)."""
        return self._stream.step(self._tokenizer, token_id) or ""


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte -> the byte."""
    if not _BYTE_LEVEL:
        printable = [
            *range(ord("!"), ord("~") + 1),
            *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1),
        ]
        extra = 0
        for b in range(256):
            if b in printable:
                _BYTE_LEVEL[chr(b)] = b
            else:
                _BYTE_LEVEL[chr(256 + extra)] = b
                extra += 1
    return _BYTE_LEVEL


_BYTE_LEVEL: dict[str, int] = {}


class TemplateTimeout(Exception):
    """A chat template ran past its deadline."""


def _deadline(deadline: float):
    """A trace function (this thread only) that stops a rendering template at deadline: it follows the
    frames of jinja2's compiled template code (file "<template>") line by line, and no other frame, so
    each loop iteration of the template checks the clock."""

    def line(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout
        return line

    def call(frame, event, arg):
        return line if frame.f_code.co_filename == "<template>" else None

    return call


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


MAX_TEMPLATE_VALUE = 1 << 24  # a template's `*` may make a string or list of at most this many items
MAX_TEMPLATE_EXPONENT_BITS = 4096  # and `**` a number of at most this many bits


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' environment (sandboxed, immutable, loop controls) whose `*` and `**` refuse results
    past a bound before computing them: `10 ** 30000000` ran 35 s in one C call holding the GIL (no trace
    function can stop it) and `'x' * 200000000` made 200 MB at once."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context, operator: str, left, right):
        if operator == "**" and _integer(left) and _integer(right) and right > 0:
            if right * max(abs(left), 2).bit_length() > MAX_TEMPLATE_EXPONENT_BITS:
                raise jinja2.TemplateError(f"the template's {left} ** {right} is too large")
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if (
                    isinstance(seq, str | list | tuple)
                    and _integer(count)
                    and len(seq) * count > MAX_TEMPLATE_VALUE
                ):
                    raise jinja2.TemplateError("the template's `*` makes a value too large")
        return super().call_binop(context, operator, left, right)


def _integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sandbox() -> ImmutableSandboxedEnvironment:
    """The environment chat templates render in (model files are untrusted input)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env


def compile_template(source: str) -> jinja2.Template:
    """A chat template compiled in the sandbox (ValueError if it does not parse)."""
    try:
        return _sandbox().from_string(source)
    except jinja2.TemplateError as e:
        raise ValueError(f"the model's chat template failed: {type(e).__name__}: {e}") from e


def render_template(
    template: jinja2.Template,
    messages: list[dict],
    bos_token: str | None,
    add_generation_prompt: bool = True,
    timeout_s: float | None = None,
) -> str:
    """Render a compiled chat template; whatever it raises becomes a ValueError. timeout_s: a template
    still running after this long (nested loops) is stopped between two of its lines: ValueError. A
    single C-level operation cannot be stopped so; the HTTP server renders in a process it can kill
    (serving.http.sandbox)."""
    previous = sys.gettrace()
    try:
        if timeout_s is not None:
            sys.settrace(_deadline(time.monotonic() + timeout_s))
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token or ""
        )
    except jinja2.TemplateError as e:
        raise ValueError(f"the model's chat template failed: {type(e).__name__}: {e}") from e
    except TemplateTimeout as e:
        raise ValueError(f"the model's chat template ran past {timeout_s} s (template_timeout_s)") from e
    except (OverflowError, RecursionError) as e:  # MemoryError goes up: the sandbox recycles its child
        raise ValueError(f"the model's chat template failed: {type(e).__name__}: {e}") from e
    finally:
        if timeout_s is not None:
            sys.settrace(previous)


def from_gguf_fields(fields: dict) -> TextTokenizer:
    """Rebuild a GPT-2-style byte-level BPE from GGUF's tokenizer.ggml.* fields."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"tokenizer.ggml.model must be 'gpt2' (byte-level BPE), got {kind!r}")
    tokens = fields["tokenizer.ggml.tokens"]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    # llama.cpp's "smollm" pre-tokenizer: digits one at a time, then the GPT-2 byte-level split
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([tokens[i] for i, t in enumerate(types) if t == GGUF_CONTROL])
    bos = fields.get("tokenizer.ggml.bos_token_id")
    return TextTokenizer(tok, fields.get("tokenizer.chat_template"), tokens[bos] if bos is not None else None)


def from_hf_dir(path: Path) -> TextTokenizer:
    """tokenizer.json (+ the chat template from tokenizer_config.json, when present)."""
    file = path / "tokenizer.json"
    if not file.exists():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    template, bos = None, None
    config = path / "tokenizer_config.json"
    if config.exists():
        cfg = json.loads(config.read_text())
        template, bos = cfg.get("chat_template"), cfg.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
    return TextTokenizer(Tokenizer.from_file(str(file)), template, bos)
