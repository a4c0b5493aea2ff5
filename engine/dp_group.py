"""A DP group's engine process (engine/dp.py's DPEngines starts groups 1..dp-1 with this as their main):
it builds the group's engine (an engine.llm.LLM of the lead's config with its own dp_rank), then serves
the lead's requests and steps over its pipe; in the prefill role it runs the group's own messenger.
"""

from __future__ import annotations

import traceback
from dataclasses import replace

import torch

from engine.disagg import DecodeSide, prefill_messenger
from engine.kv.cache import OutOfPages
from engine.llm import LLM
from engine.tp import from_lead
from pdkernels import ops

SIDE_METHODS = ("reserve", "admit", "fail", "free", "set_aside", "recompute")  # what DPEngines.call may run


def _counters(llm) -> dict:
    """An engine's counters, for the lead's sums (engine.llm.LLM's own: this engine fronts no other)."""
    return {
        "pages": llm.pages,
        "queues": llm.queues,
        "prefix_cache_stats": llm.prefix_cache_stats,
        "preemption_stats": llm.preemption_stats,
        "grammar_compiles": llm.grammar_compiles,
    }


def _stats(llm) -> dict:
    """An engine's counters after its step, and what happened in it for the lead to take."""
    return {
        **_counters(llm),
        "cache_events": llm.allocator.take_events(),
        "refetches": [(q.request_id, q.all_ids, q.params) for q in llm.front.take_refetches()],
        "busy": llm.has_unfinished(),
    }


def main(rank: int, config, rendezvous: str, conn, backend: str, lead: int) -> None:
    """DP group `rank`'s engine: build it (of the lead's config; it joins the process group), then serve
    the lead's requests and steps until told to stop, or until the lead is gone."""
    llm = pm = None
    try:
        torch.set_num_threads(1)
        ops.set_backend(backend)  # the lead's choice, not this process's environment
        llm = LLM(replace(config, dp_rank=rank), rendezvous=rendezvous)
        role = llm.config.scheduler.role
        conn.send(("ready", llm.kv_regions if role.receives_kv else None))  # shared memory: the front maps it
        side = DecodeSide(llm)
        for kind, payload in from_lead(conn, lead):
            if kind == "add":
                try:
                    llm.add_request(*payload)
                    conn.send(("added", None))
                except (ValueError, TypeError) as e:
                    conn.send(("refused", str(e)))
            elif kind == "abort":
                llm.abort(*payload)
            elif kind == "record":
                llm.allocator.record_events()
            elif kind == "grammar":  # loaded in the front first: the same vocabulary, it loads here too
                llm.core.grammars.load(*payload)
            elif kind == "prefill_messenger":  # prefill role: this group's own messenger and agent
                pm = _prefill_messenger(llm, rank, *payload)
                conn.send(("done", pm.agents.names))
            elif kind == "poll":
                if pm is not None:
                    pm.poll()
                conn.send(("polled", llm.has_unfinished()))
            elif kind == "counters":
                conn.send(("counters", _counters(llm)))
            elif kind == "side":  # the front's decode messenger, on this group's requests
                method, call_args = payload
                if method not in SIDE_METHODS:
                    raise ValueError(f"no DecodeSide method {method!r}")
                try:
                    conn.send(("done", getattr(side, method)(*call_args)))
                except OutOfPages as e:
                    conn.send(("refused", ("OutOfPages", str(e))))
                except (ValueError, TypeError) as e:
                    conn.send(("refused", ("ValueError", str(e))))
            elif kind == "step":
                if pm is not None:
                    pm.poll()  # what arrived since its last poll joins this step
                outs = llm.step()
                if role.sends_kv:  # its messenger's requests: the lead has nothing to do with them
                    outs = []
                for out in outs:  # the lead has them: not pickled again every step
                    out.prompt, out.prompt_token_ids = None, []
                conn.send(("stepped", (outs, _stats(llm))))
    except Exception:
        try:
            conn.send(("failed", traceback.format_exc()))
        except (BrokenPipeError, OSError):
            pass
    finally:
        if pm is not None:
            pm.close()
            for backend in pm.agents.backends:
                backend.close()
        if llm is not None:
            llm.close()


def _prefill_messenger(llm, rank: int, transfer, agent: str, peers: list[tuple[str, str]], creds):
    """Prefill role: DP group rank's messenger in its engine's process, over its own KV, layer counter and
    NIXL agents (one per TP rank, each on its transfer.nics_per_rank NIC), connected to each decode worker's
    control address for this group (peers: (decode worker, address)). Each group is a prefill peer of its
    own to them."""
    from transfer.backends import rank_agents
    from transfer.channel import ZmqEndpoint
    from transfer.protocol import prefill_codec

    if transfer.backend != "nixl":
        raise ValueError("a DP group's messenger runs in another process: it needs transfer.backend nixl")
    pm = prefill_messenger(llm, rank_agents(transfer, agent, llm.config.tp, rank), transfer)
    for peer, address in peers:
        pm.add_peer(ZmqEndpoint(address, False, creds, peer, prefill_codec()))
    return pm
