"""A request body's fields as the field's clients send them (serving/http/fields.py): chat content
as a string or a list of parts, and the OpenAI API's other chat fields, each taken or refused by name."""

import pytest

from serving.http.errors import ApiError
from serving.http.fields import extras, messages_of


def test_content_as_text_parts_is_joined_as_vllm_joins_it():
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    chat = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": parts, "name": "alice"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": []},
        {"role": "user", "content": "again"},
    ]
    assert messages_of(chat) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello\nworld"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "again"},
    ]
    assert messages_of([{"role": "user", "content": []}]) == [{"role": "user", "content": ""}]


@pytest.mark.parametrize(
    "message, named",
    [
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "content[0].type"),
        ({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}, "content[1]"),
        ({"role": "user", "content": [{"type": "text", "text": 5}]}, "content[0]"),
        ({"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}, "content[0]"),
        ({"role": "user", "content": ["plain string part"]}, "content[0].type"),
        ({"role": "user", "content": 5}, "content"),
        ({"role": "user", "content": None}, "content"),  # only an assistant's may be null
        ({"role": "tool", "content": "42", "tool_call_id": "c"}, "role"),
        ({"role": "function", "content": "42"}, "role"),
        ({"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}, "tool_calls"),
        ({"role": "user", "content": "hi", "weight": 2}, "weight"),
        ({"role": "user", "content": "hi", "name": "n" * 300}, "name"),
        ("not an object", "messages[0]"),
    ],
)
def test_a_part_or_key_no_model_here_takes_is_a_400_naming_where_it_is(message, named):
    with pytest.raises(ApiError) as err:
        messages_of([message])
    assert err.value.status == 400 and err.value.param == "messages"
    assert named in err.value.message, err.value.message


@pytest.mark.parametrize("messages", [None, [], "hi", {"role": "user"}])
def test_messages_must_be_a_non_empty_list(messages):
    with pytest.raises(ApiError, match="messages must be a non-empty list"):
        messages_of(messages)


def test_a_hundred_thousand_parts_are_joined_without_recursion():
    parts = [{"type": "text", "text": "x"}] * 100_000
    assert len(messages_of([{"role": "user", "content": parts}])[0]["content"]) == 199_999


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"metadata": {"team": "a", "run": "7"}, "store": False, "service_tier": "auto"},
        {"tools": [], "tool_choice": "auto", "parallel_tool_calls": True},
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
        {"prompt_cache_key": "conversation-1", "safety_identifier": "user-hash"},
        {"metadata": None, "tools": None, "tool_choice": None, "parallel_tool_calls": None},
    ],
)
def test_the_chat_fields_clients_send_by_default_are_taken(body):
    extras(body)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 5}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": ["k", "v"]}, "metadata"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools"),
        ({"tools": "f"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"prompt_cache_key": ""}, "prompt_cache_key"),
        ({"safety_identifier": 7}, "safety_identifier"),
    ],
)
def test_a_chat_field_past_what_it_means_here_is_a_400_naming_it(body, param):
    with pytest.raises(ApiError) as err:
        extras(body)
    assert err.value.status == 400 and err.value.param == param
