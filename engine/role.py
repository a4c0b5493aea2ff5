"""A worker's role, and what differs between the roles: one `Traits` each, read as the role's attributes
(`role.samples`, `role.sends_kv`, ...), so that no code compares role names.

    prefill    computes prompts and sends their KV to decode workers; never samples (its last token is
               the decode side's first step), so it keeps no state a restart would lose
    decode     receives prompts' KV, reserves pages for it, samples every token; a preempted request's KV
               is fetched again from a prefill worker
    colocated  does both in one engine
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


@dataclass(frozen=True)
class Traits:
    prefills: bool  # computes its requests' prompts (a decode worker's KV comes from prefill workers)
    samples: bool  # runs decode steps and samples tokens: drafts, grammars, CUDA graphs, the router's cache
    sends_kv: bool  # a prefill messenger: the layer counter its passes bump, the writes it posts
    receives_kv: (
        bool  # a decode messenger: pages reserved for a prefill worker's writes, counted as they land
    )
    restartable: bool  # a launcher may restart it in place: nothing of a request is lost with it
    switchable: bool  # an elastic worker may move it to the other disaggregated role


def _trait(name: str) -> property:
    """A Role's attribute read from its Traits (a property: not an enum member)."""
    return property(lambda role: getattr(_TRAITS[role], name), doc=f"Traits.{name} of the role")


class Role(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"

    @classmethod
    def parse(cls, value: object) -> Role:
        """value as a Role; a ValueError naming the allowed ones otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"role must be one of {', '.join(cls)}, got {value!r}") from None

    @property
    def traits(self) -> Traits:
        return _TRAITS[self]

    prefills = _trait("prefills")
    samples = _trait("samples")
    sends_kv = _trait("sends_kv")
    receives_kv = _trait("receives_kv")
    restartable = _trait("restartable")
    switchable = _trait("switchable")

    @property
    def other(self) -> Role:
        """The disaggregated role an elastic worker in this one moves to (ValueError for colocated)."""
        if not self.switchable:
            raise ValueError(f"a {self} worker has no other role to move to")
        return Role.DECODE if self is Role.PREFILL else Role.PREFILL


_TRAITS = {
    Role.PREFILL: Traits(
        prefills=True, samples=False, sends_kv=True, receives_kv=False, restartable=True, switchable=True
    ),
    Role.DECODE: Traits(
        prefills=False, samples=True, sends_kv=False, receives_kv=True, restartable=False, switchable=True
    ),
    Role.COLOCATED: Traits(
        prefills=True, samples=True, sends_kv=False, receives_kv=False, restartable=True, switchable=False
    ),
}
