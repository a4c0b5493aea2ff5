"""A decode worker's requests before its engine runs them: the backlog of prompts whose KV a prefill
worker is to send (new requests, migrated ones, and preempted ones whose KV is fetched again, at the
front), n > 1 completions that wait for their first one's KV (`after`), and the wait for a prefill worker
being restarted. The worker (serving.worker) owns its socket and steps its engine; this is
the one place its decode-side state lives before a PrefillRequest goes out: each request in the backlog is
WAITING in its messenger's hand-off (transfer/handoff.py), and every way out of the backlog is a move there.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from engine.fair import Shares
from transfer.handoff import Cause, DecodeState

log = logging.getLogger(__name__)


@dataclass
class Waiting:
    """A request waiting for its KV from a prefill worker."""

    request_id: str
    token_ids: list[int]  # its prompt (and, migrated or refetched, its outputs so far)
    params: object  # engine.SamplingParams
    peer: str | None = None  # the router's choice of prefill worker (None: the messenger's)
    group: int | None = 0  # the DP group whose engine takes it (engine/dp.py; None: the least busy then)


@dataclass
class DecodeFront:
    """What a decode worker holds of its requests outside the engine's scheduler."""

    llm: object  # engine.LLM
    local_max_tokens: int  # deployment.local_prefill_max_tokens: shorter prompts are prefilled here
    restart_wait_s: float  # how long a prefill worker that went down is waited for (it may restart)
    backlog: deque = field(default_factory=deque)  # of Waiting, in the order they go to prefill
    after: dict[str, str] = field(default_factory=dict)  # a later completion waiting -> its first one
    prefilled_here: dict[str, Cause] = field(default_factory=dict)  # request -> why its prompt was computed
    # here, not sent (until its Result): BY_LOAD (the router sent it), CACHED (a sibling's KV), SHORT (what
    # the prefix cache lacked was short)
    returning: dict[str, float] = field(default_factory=dict)  # restarting prefill worker -> until when
    name: str = ""  # this worker's: a Submit whose prefill_worker names it is prefilled here (by load)
    dm: object = None  # transfer.decode.DecodeMessenger, while this worker decodes: its hand-off's table

    def take(self, msg, params, live) -> None:
        """A Submit this decode worker's messenger serves (raises ValueError/TypeError for one the engine
        refuses): a prompt short enough, or one the router sends here because the prefill workers'
        queue is too long (deployment.local_prefill_by_load), is prefilled here; the rest wait for a
        prefill worker's KV."""
        by_load = bool(self.name) and msg.prefill_worker == self.name
        if len(msg.prompt_ids) + len(msg.output_ids) <= self.local_max_tokens or by_load:
            rid, outs, group = msg.request_id, msg.output_ids, msg.dp_rank  # the router's DP group
            self.llm.add_request(msg.prompt_ids, params, rid, outs, msg.after, dp_rank=group)
            self.dm.handoff.move(rid, DecodeState.RECOMPUTING, Cause.BY_LOAD if by_load else Cause.SHORT)
            if by_load:  # counted as a local prefill, and as one by load
                self.prefilled_here[rid] = Cause.BY_LOAD
        elif msg.output_ids:  # migrated: its prompt and outputs so far come from a prefill worker
            seq = self.llm.front.make_sequence(msg.prompt_ids, params, msg.request_id, msg.output_ids)
            self.llm.core.resume(seq)  # DP group 0's engine resumes it (the one in this process)
            self.dm.wait(msg.request_id)
            self.backlog.append(Waiting(msg.request_id, seq.all_ids, params))
        else:
            self.llm.front.make_sequence(msg.prompt_ids, params, msg.request_id)  # check it now
            group = msg.dp_rank  # the router's choice of DP group (None: chosen when it is sent)
            self.dm.wait(msg.request_id)
            self.backlog.append(Waiting(msg.request_id, msg.prompt_ids, params, msg.prefill_worker, group))
            if msg.after in live:  # n > 1: its KV comes with the first completion's
                self.after[msg.request_id] = msg.after

    def drop(self, request_id: str, cause: Cause = Cause.CANCELLED) -> bool:
        """Take a request out of the backlog (cancelled; handed back: ABORTED); whether it was there."""
        self.after.pop(request_id, None)
        self.prefilled_here.pop(request_id, None)
        for item in self.backlog:
            if item.request_id == request_id:
                self.backlog.remove(item)
                self.dm.leave(request_id, cause)
                return True
        return False

    def refetch(self, seqs) -> None:
        """Preempted sequences whose KV is fetched again (into the DP group that holds each): before any
        new request."""
        group = self.llm.front.dp_rank_of
        items = [Waiting(s.request_id, s.all_ids, s.params, group=group(s.request_id)) for s in seqs]
        for item in items:
            self.dm.wait(item.request_id)
        self.backlog.extendleft(reversed(items))

    def waiting_for_restart(self, dm) -> bool:
        """Every prefill worker is down and one may come back (restarted): hold new requests for it.
        A peer this worker sees gone (lost, or its pid gone on this host) is waited for restart_wait_s
        from then, or as long as the runtime's PeerDead says (0: it is not restarted)."""
        now, down = time.monotonic(), []
        for name, peer in dm.peers.items():
            if peer.down():
                down.append(name)
                self.returning.setdefault(name, now + self.restart_wait_s)
            else:
                self.returning.pop(name, None)  # up (again): a later death waits afresh
        return len(down) == len(dm.peers) and any(self.returning[n] > now for n in down)

    def drain(self, refuse) -> None:
        """Send what waits to the prefill workers (the decode messenger's submit), while pages last;
        refuse(request_id, error) ends one the plan or the engine refuses."""
        from engine.kv.cache import OutOfPages
        from transfer.decode import NoFreeSlot

        dm = self.dm
        if self.backlog and self.waiting_for_restart(dm):
            return
        shares = Shares(self.llm.scheduler.admitted())
        while self.backlog:
            # the client holding the fewest here goes first (engine/fair.py): refetches first among its own
            item = min(self.backlog, key=shares.rank)
            rid = item.request_id
            first = self.llm.core.seqs.get(self.after.pop(rid, ""))
            if first is not None and not first.finished and first.prompt_ids == item.token_ids:
                # n > 1: the first completion's transfer serves this one too (engine: add_request after)
                self.backlog.remove(item)
                self.llm.add_request(item.token_ids, item.params, rid, after=first.request_id)
                dm.handoff.move(rid, DecodeState.DECODING, Cause.CACHED)
                self.prefilled_here[rid] = Cause.CACHED
                continue
            try:
                salt = item.params.cache_salt or ""
                local = self.local_max_tokens
                if not dm.submit(
                    rid,
                    item.token_ids,
                    item.params,
                    local_max_tokens=local,
                    prefer=item.peer,
                    cache_salt=salt,
                    client=item.params.client or (),
                    group=item.group if item.group is not None else self.llm.front.least_busy_group(),
                ):
                    self.prefilled_here[rid] = Cause.SHORT
            except (OutOfPages, NoFreeSlot):
                return  # pages come back as running requests finish (engine.scheduler: room to finish),
                # context slots as transfers land
            except (ValueError, TypeError) as e:  # the plan or the engine refused it
                dm.leave(rid, Cause.ERROR)
                if self.llm.front.holds(rid):  # a refetch: it ends with its tokens so far
                    self.llm.abort(rid, f"could not fetch its KV again: {e}")
                else:
                    refuse(rid, e)
            self.backlog.remove(item)
            shares.add(item)
