"""A request body's fields, each checked where it is read: every refusal is a 400 (ApiError) that names
the field and what it may be. serving.http.api puts them together into a Submit."""

from __future__ import annotations

import hashlib
import json
import math
import secrets

from engine.sequence import MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY, MIN_TEMPERATURE
from serving.http.errors import ApiError

COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "ignore_eos",
    "stream",
    "stream_options",
    "n",
    "user",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "stop_token_ids",
    "include_stop_str_in_output",
    "structured_outputs",
    "cache_salt",
}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
# the OpenAI API's further chat fields that the field's clients send (SDKs' typed helpers, LangChain,
# LiteLLM, agent frameworks): each taken as far as it means something here (extras() checks them)
CHAT_FIELDS = COMMON | {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "response_format",
    "metadata",
    "store",
    "service_tier",
    "modalities",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
}
# fields taken only at these values (what the API does without them); any other is a 400 naming it
UNSUPPORTED_UNLESS = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "store": (None, False),  # nothing is stored here
    "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]),  # no model here speaks audio
}
MAX_TOP_LOGPROBS = {True: 20, False: 5}  # chat's top_logprobs, completions' logprobs (OpenAI's bounds)
MAX_TOKEN_LIST = 1024  # entries of logit_bias or stop_token_ids
MAX_SALT_CHARS = 256  # of cache_salt and user
COMPILED_CHARS = 256 << 20  # compiled grammars the server keeps, by their serialized length


def number(body: dict, key: str, default, low=None, high=None, integer=False, low_open=False):
    value = body.get(key, default)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ApiError(400, f"{key} must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if isinstance(value, float) and not math.isfinite(value):
        raise ApiError(400, f"{key} must be a finite number, got {value!r}", key)
    if low is not None and (value <= low if low_open else value < low):
        raise ApiError(400, f"{key} must be {'>' if low_open else '>='} {low}, got {value!r}", key)
    if high is not None and value > high:
        raise ApiError(400, f"{key} must be <= {high}, got {value!r}", key)
    return value


def temperature_of(body: dict) -> float:
    """0 (greedy) or [MIN_TEMPERATURE, 2] (OpenAI's top): below the floor the sampler's logits overflow."""
    value = float(number(body, "temperature", 1.0, 0, 2))
    if 0 < value < MIN_TEMPERATURE:
        raise ApiError(
            400, f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, 2], got {value!r}", "temperature"
        )
    return value


def sampling_fields(body: dict, chat: bool, max_tokens: int, vocab: int, spec) -> dict:
    """vLLM's further sampling fields, logprobs and the structured-output spec (engine.StructuredOutputs,
    or None), checked, as SamplingParams' keyword arguments."""
    out = {
        "presence_penalty": float(number(body, "presence_penalty", 0.0, -2, 2)),
        "frequency_penalty": float(number(body, "frequency_penalty", 0.0, -2, 2)),
        "repetition_penalty": float(
            number(body, "repetition_penalty", 1.0, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)
        ),
        "min_p": float(number(body, "min_p", 0.0, 0, 1)),
        "min_tokens": number(body, "min_tokens", 0, 0, max_tokens, integer=True),
    }
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict) or len(bias) > MAX_TOKEN_LIST:
        raise ApiError(
            400,
            f"logit_bias must map at most {MAX_TOKEN_LIST} token ids to biases in [-100, 100]",
            "logit_bias",
        )
    out["logit_bias"] = {}
    for key, value in bias.items():
        ascii_digits = isinstance(key, str) and key.isascii() and key.isdigit()  # "²", "٥": no
        token = int(key) if ascii_digits and len(key) < 10 else -1
        if not 0 <= token < vocab:
            raise ApiError(
                400, f"logit_bias keys must be token ids in [0, {vocab}), got {key!r}", "logit_bias"
            )
        out["logit_bias"][token] = float(number({"logit_bias": value}, "logit_bias", 0.0, -100, 100))
    ids = body.get("stop_token_ids") or []
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_TOKEN_LIST
        or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids)
    ):
        raise ApiError(
            400,
            f"stop_token_ids must be a list of at most {MAX_TOKEN_LIST} token ids in [0, {vocab})",
            "stop_token_ids",
        )
    out["stop_token_ids"] = list(ids)
    keep = body.get("include_stop_str_in_output", False)
    if not isinstance(keep, bool):
        raise ApiError(
            400,
            f"include_stop_str_in_output must be a boolean, got {keep!r}",
            "include_stop_str_in_output",
        )
    out["include_stop_str_in_output"] = keep
    # chat: logprobs (a boolean) and top_logprobs (0-20); completions: logprobs (0-5)
    most = MAX_TOP_LOGPROBS[chat]
    if chat:
        wanted = body.get("logprobs", False)
        if wanted is not None and not isinstance(wanted, bool):
            raise ApiError(400, f"logprobs must be a boolean, got {wanted!r}", "logprobs")
        top = number(body, "top_logprobs", None, 0, most, integer=True)
        if top is not None and not wanted:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        out["logprobs"] = (top or 0) if wanted else None
    else:
        out["logprobs"] = number(body, "logprobs", None, 0, most, integer=True)
    out["structured_outputs"] = spec
    return out


def cache_salt_of(body: dict, isolation: str) -> str | None:
    """The salt a request's prefix-cache pages are named with (server.cache_isolation): requests of
    different salts share no page, so none can find or time a prefix another one computed, and
    usage.prompt_tokens_details.cached_tokens counts only its own salt's pages."""
    salt, user = body.get("cache_salt"), body.get("user")
    for key, value in (("cache_salt", salt), ("user", user)):
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_SALT_CHARS):
            raise ApiError(400, f"{key} must be a string of 1-{MAX_SALT_CHARS} characters", key)
    if isolation == "user" and user is not None:
        return hashlib.sha256(json.dumps([user, salt]).encode()).hexdigest()  # unambiguous, 64 chars
    if isolation == "salt" and salt is None:
        return secrets.token_hex(16)  # no salt given: it shares nothing
    return salt


ROLES = ("system", "developer", "user", "assistant")  # developer: OpenAI's newer name for system
MESSAGE_KEYS = {"role", "content", "name"}
ASSISTANT_NONE = ("refusal", "tool_calls", "function_call", "audio")  # taken when null (or an empty list)


def messages_of(messages) -> list[dict[str, str]]:
    """The chat as the model's template takes it, [{role, content: str}]: content a string or a list of
    text parts (joined by newlines, as vLLM joins them); an assistant's may be null. An image, audio or
    file part, a tool message or call, or a key the API does not have is a 400 naming where it is."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object {{role, content}}", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role={role!r} is not supported: one of {ROLES}", "messages")
        for key, value in m.items():
            if key in MESSAGE_KEYS or (role == "assistant" and key in ASSISTANT_NONE and value in (None, [])):
                continue
            what = "tool calls need tools, and none are served here" if "call" in key else "not supported"
            raise ApiError(400, f"{where}.{key}: {what} (a message takes {sorted(MESSAGE_KEYS)})", "messages")
        name = m.get("name")
        if name is not None and (not isinstance(name, str) or not 0 < len(name) <= MAX_SALT_CHARS):
            raise ApiError(400, f"{where}.name must be a string of 1-{MAX_SALT_CHARS} characters", "messages")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        elif isinstance(content, list):
            content = "\n".join(_text_part(part, f"{where}.content[{j}]") for j, part in enumerate(content))
        elif not isinstance(content, str):
            what = "a string or a list of text parts {type: text, text}"
            raise ApiError(400, f"{where}.content must be {what}", "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _text_part(part, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str) and set(part) <= {"type", "text"}:
        return part["text"]
    if kind == "text":
        raise ApiError(400, f"{where} must be {{type: text, text: string}}", "messages")
    what = "is not supported: this model takes text parts only (type: text)"
    raise ApiError(400, f"{where}.type={kind!r} {what}", "messages")


MAX_METADATA = 16  # OpenAI's bounds on metadata: 16 pairs, keys of 64 characters, values of 512


def extras(body: dict) -> None:
    """The chat fields this server takes without acting on them, checked: metadata (OpenAI's bounds),
    tools only with tool_choice none (the model is never asked to call one), parallel_tool_calls a
    boolean, prompt_cache_key and safety_identifier strings like user."""
    meta = body.get("metadata")
    pairs = meta.items() if isinstance(meta, dict) else ()
    fits = all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in pairs)
    if meta is not None and not (isinstance(meta, dict) and len(meta) <= MAX_METADATA and fits):
        raise ApiError(
            400, f"metadata must map at most {MAX_METADATA} keys (64 characters) to strings (512)", "metadata"
        )
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise ApiError(400, "tools must be a list", "tools")
    if tools and choice != "none":
        raise ApiError(
            400, "tools are not served here: give tool_choice: none (the model then answers in text)", "tools"
        )
    if choice not in (None, "none", "auto"):
        what = "is not supported: none (or auto without tools)"
        raise ApiError(400, f"tool_choice={choice!r} {what}", "tool_choice")
    if not isinstance(body.get("parallel_tool_calls", False), bool | None):
        raise ApiError(400, "parallel_tool_calls must be a boolean", "parallel_tool_calls")
    for key in ("prompt_cache_key", "safety_identifier"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_SALT_CHARS):
            raise ApiError(400, f"{key} must be a string of 1-{MAX_SALT_CHARS} characters", key)


def structured_of(body: dict):
    """(engine.StructuredOutputs, the field it came from) from chat's response_format or vLLM's
    structured_outputs (either, not both), or None; its grammar is built in the sandbox (App._compile)."""
    from engine.structured import KINDS, StructuredOutputs

    fmt, extra = body.get("response_format"), body.get("structured_outputs")
    if fmt is not None and extra is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both", "structured_outputs")
    if fmt is not None:
        param, kind = "response_format", fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            kwargs = {"json_object": True}
        elif kind == "json_schema" and isinstance(fmt.get("json_schema"), dict):
            kwargs = {"json": fmt["json_schema"].get("schema", {})}
        else:
            raise ApiError(
                400,
                "response_format must be {type: text | json_object} or {type: json_schema, json_schema: "
                "{name, schema}}",
                param,
            )
    elif extra is not None:
        param = "structured_outputs"
        if not isinstance(extra, dict) or len(extra) != 1 or next(iter(extra)) not in KINDS:
            raise ApiError(400, f"structured_outputs must be an object with exactly one of {KINDS}", param)
        kwargs = dict(extra)
    else:
        return None
    try:
        spec = StructuredOutputs(**kwargs)
    except (TypeError, ValueError) as e:
        raise ApiError(400, str(e), param) from e
    return spec, param


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
    """A request body's JSON, or a 400 that says why not."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError as e:
        raise ApiError(400, "the request body is nested too deeply") from e
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, NaN, an integer past 4,300 digits
        raise ApiError(400, f"the request body is not JSON this server takes: {e}") from e
    try:  # a lone surrogate ("\\ud800") parses, but is no text: refuse it here, not in the tokenizer
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError as e:
        raise ApiError(400, "the request body holds a lone surrogate (not valid Unicode text)") from e
    return body
