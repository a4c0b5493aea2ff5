"""The wire format of every socket in the package: msgspec structs in msgpack, one strict decoder per channel.

Nothing received is unpickled or evaluated. A channel names the message types it accepts; bytes that do
not decode to one of them (wrong type, a missing or extra field, a value its own checks refuse) raise
`WireError`, which the receiver counts and drops. Structs and dataclasses run their `__post_init__`
checks on decode, so a received object is validated by the same code as a local one.
"""

from __future__ import annotations

import logging
from typing import Union

import msgspec

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # every socket refuses larger frames (zmq.MAXMSGSIZE)


class WireError(ValueError):
    """Received bytes that are not a valid message of the channel."""


class Message(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Base of every message that crosses a socket; the class name travels as its tag."""


class Codec:
    """Encode any message; decode only the given types (a tagged union), strictly."""

    def __init__(self, *types: type):
        self.types = types
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Union[types] if len(types) > 1 else types[0])  # noqa: UP007
        self.dropped = 0  # frames that failed to decode

    def encode(self, msg: Message) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, data: bytes):
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError) as e:
            self.dropped += 1
            raise WireError(f"dropped a malformed message ({len(data)} bytes): {e}") from e
