"""The API layer's request checks that need no server (serving/http/api.py)."""

import pytest

from serving.http.api import ServerConfig
from serving.http.errors import ApiError
from serving.http.fields import cache_salt_of


def test_cache_isolation_decides_who_shares_pages():
    alice, bob = {"user": "alice"}, {"user": "bob"}
    assert cache_salt_of(alice, "none") is None and cache_salt_of({"cache_salt": "t"}, "none") == "t"
    # user: each user's pages apart, and within a user the cache_salt still splits
    assert cache_salt_of(alice, "user") != cache_salt_of(bob, "user")
    assert cache_salt_of(alice, "user") == cache_salt_of(dict(alice), "user")
    assert cache_salt_of({**alice, "cache_salt": "x"}, "user") != cache_salt_of(alice, "user")
    assert cache_salt_of({}, "user") is None
    # salt: a request without one shares nothing, not even with another request without one
    assert cache_salt_of({}, "salt") != cache_salt_of({}, "salt")
    assert cache_salt_of({"cache_salt": "t"}, "salt") == "t"


@pytest.mark.parametrize(
    "body", [{"cache_salt": ""}, {"cache_salt": 5}, {"user": "u" * 257}, {"cache_salt": ["a"]}]
)
def test_a_bad_salt_or_user_is_a_400_naming_it(body):
    with pytest.raises(ApiError) as err:
        cache_salt_of(body, "user")
    assert err.value.status == 400 and err.value.param == next(iter(body))


def test_the_isolation_switch_is_checked():
    with pytest.raises(ValueError, match="server.cache_isolation='tenant' is not allowed: one of"):
        ServerConfig(cache_isolation="tenant")


@pytest.mark.parametrize(
    "kind, status",
    [("rejected", 503), ("worker_lost", 503), ("cancelled", 503), ("deadline", 504), ("internal", 500)],
)
def test_a_failed_request_s_error_names_its_kind_in_code(kind, status):
    """Rejected, cancelled and worker_lost all answer 503, and the load client counted every 503
    as a refusal; the body's `code` says which it was."""
    from serving.http.api import App
    from serving.messages import ErrorKind, Result

    result = Result.failed("r", ErrorKind(kind), "why", "decode-0", 0.0)
    with pytest.raises(ApiError) as e:
        App.finished(None, None, result)
    assert e.value.status == status and e.value.body()["error"]["code"] == kind
