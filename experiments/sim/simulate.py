"""Discrete-event simulation of colocated and xPyD serving over the cost model.

Instances are simulated step by step: each step's duration comes from CostModel.step_time for what the
instance's scheduler put in it, and requests that arrive (or whose KV lands) during a step join at the
next step boundary. A colocated instance runs continuous batching, with chunked prefill (decode tokens
first, then prefill chunks under a token budget, as engine/scheduler.py) or without (whole-prompt
prefill steps first, as vLLM v0). A prefill instance batches whole prompts FCFS under the budget; a
request then moves its KV to the least-loaded decode instance (request-level, or layer-streamed where
only what compute cannot hide shows) and decodes there. With router='decode' a request first goes to
the decode instance with the fewest in flight, which forwards it to a prefill instance between its
steps, and its KV comes back to that instance. KV capacity is what HBM holds after the weights (or
kv_tokens). A colocated or prefill instance admits a request only when its whole KV (prompt + output)
fits. A decode instance admits as the engine's scheduler does, with room to finish: it holds the KV of
the request's context plus min(the outputs left, reserved_tokens) (None: all of them); a request that
runs past that takes a free slot per token, or is preempted when none is left: its KV is dropped and
either recomputed on the decode instance (a prefill chunk in its next step) or refetched from a prefill
instance (prompt + outputs so far). reserved_tokens=0 is the old rule (the prompt's KV only), which
thrashes once the decode instance fills.

Prefix caching (an instance's `cache`, a PageCache; the request, cache and instance types are in
experiments/sim/instance.py): a request's KV is a row of pages of `page_size`
tokens, named by what they hold: the first `shared` tokens are common to every request (a system
prompt), the rest belong to its `stream` (a conversation: turn t+1's prompt is turn t's prompt, reply and
a new message, so its pages are named as turn t's were). A colocated or prefill instance computes a
request from its longest cached prefix on (its last token always); pages are named when its prefill ends
and, for the instance that decodes it, when it finishes (the reply's pages too, as the engine names them
while decoding). A disaggregated request first looks up its decode instance's cache: the prefill
instance sends only the pages from there on, or, where what is missing is at most
`local_prefill_max_tokens`, the decode instance computes it in its own next step. Each cache is an LRU
over page names holding at most the instance's KV capacity in pages; pages in use count toward it as
cached ones (an approximation: the engine evicts only pages no request holds). A preempted request's pages
are not kept (its refetch or recompute looks nothing up).

Output per request: arrival, first-token time and the time of each later token, from which the same
metrics as the real runs follow (experiments/metrics.py's percentiles and SLO rules).
"""

from __future__ import annotations

import heapq

import numpy as np

from experiments.deploy.messages import LOAD_EVERY_S, Load
from experiments.deploy.policy import Planner, PlannerConfig, Router
from experiments.sim.cost import transfer_time
from experiments.sim.instance import Instance, SimRequest


def _admit(inst: Instance, need: int) -> bool:
    if inst.kv_used + need > inst.kv_capacity_tokens and inst.running:
        return False
    inst.kv_used += need
    return True


def _colocated_step(inst: Instance, now: float) -> tuple[float, list]:
    """Schedule one step; returns (duration, [(request, kind)]) with kind 'prefill_done' | 'token'."""
    budget = inst.budget
    decode = [r for r in inst.running if r.computed == r.context][: inst.max_seqs]
    chunks, events = [], []
    if inst.chunked or not inst.waiting and not any(r.computed < r.context for r in inst.running):
        budget -= len(decode)
    else:
        decode = []  # a whole-prompt prefill step runs alone
    for r in [r for r in inst.running if r.computed < r.context]:
        if budget <= 0:
            break
        n = min(r.context - r.computed, budget if inst.chunked else r.context)
        chunks.append((r, n))
        budget -= n
    while inst.waiting and budget > 0 and len(inst.running) < inst.max_seqs:
        r = inst.waiting[0]
        cached = len(inst.cache.peek(r, r.context, inst.page_size)) if inst.cache and not r.fetch else 0
        if not inst.chunked and r.context - cached * inst.page_size > budget and chunks:
            break
        if not _admit(inst, r.context + r.output):
            break
        inst.waiting.pop(0)
        inst.running.append(r)
        if inst.cache is not None and not r.fetch:
            r.computed = inst.cache.lookup(r, r.context, inst.page_size) * inst.page_size
            r.cached = r.computed
        left = r.context - r.computed
        n = min(left, budget) if inst.chunked else left
        chunks.append((r, n))
        budget -= n
    if not chunks and not decode:
        return 0.0, []
    inst.last_step = (sum(n for _, n in chunks), len(decode))
    verify, decode, drafts = _verify_chunks(inst, decode)
    sampled = len(decode) + sum(1 for r, n in chunks if r.computed + n == r.context) + drafts
    dt = inst.cost.step_time(
        [(n, r.computed) for r, n in chunks] + verify, [r.prompt + r.generated for r in decode], sampled
    )
    for r, n in chunks:
        r.computed += n
        if r.computed == r.context:
            events.append((r, "prefill_done"))
    return dt, events + _decode_events(inst, decode)


def _verify_chunks(inst: Instance, decode: list) -> tuple[list, list, int]:
    """With speculation, each decode sequence's step computes its token and k drafts: (chunks of
    (k + 1 tokens, KV length) for the cost model, the sequences without drafts, rows sampled)."""
    if not inst.spec_k:
        return [], decode, 0
    chunks, plain, rows = [], [], 0
    for r in decode:
        k = min(inst.spec_k, r.output - r.generated - 1)
        if k <= 0:
            plain.append(r)
            continue
        r.drafting = k
        chunks.append((k + 1, r.prompt + r.generated))
        rows += k + 1
    return chunks, plain, rows


def _decode_events(inst: Instance, plain: list) -> list:
    """('tokens', n) per decoding sequence: 1 without drafts; with k drafts, the accepted prefix (each
    draft accepted with spec_acceptance while the ones before it were) and the target's next token."""
    events = [(r, ("tokens", 1)) for r in plain]
    for r in [r for r in inst.running if r.drafting]:
        k, r.drafting = r.drafting, 0
        accepted = 0
        while accepted < k and inst.rng.random() < inst.spec_acceptance:
            accepted += 1
        r.drafted, r.accepted, r.verifies = r.drafted + k, r.accepted + accepted, r.verifies + 1
        events.append((r, ("tokens", accepted + 1)))
    return events


def simulate_colocated(
    instances: list[Instance],
    requests: list[SimRequest],
    follow=None,
    concurrency: int | None = None,
    policy: Router | None = None,
) -> list[SimRequest]:
    """Requests go to the instance the policy picks (a Router over the instances' indices, as the real
    drivers' over their workers; default: the fewest requests in flight); each samples its first token
    after its prompt's last chunk and one token per later step.

    follow: a closed loop (a multiturn workload): called with each request as it finishes, it returns the
    request that follows it (arriving when that says) or None; the ones it returns are added to requests.
    concurrency: at most this many requests in flight; one that arrives beyond waits for a slot."""
    return _run(instances, [], requests, "prefill", follow=follow, concurrency=concurrency, policy=policy)


def simulate_disaggregated(
    prefill: list[Instance],
    decode: list[Instance],
    requests: list[SimRequest],
    layerwise: bool = True,
    first_token_on: str = "prefill",
    router: str = "prefill",
    follow=None,
    concurrency: int | None = None,
    policy: Router | None = None,
    planner: PlannerConfig | None = None,
    slo: tuple[float, float] = (float("inf"), float("inf")),
    switch_s: float = 0.05,
    moves: list | None = None,
) -> list[SimRequest]:
    """xPyD: prefill instances compute prompts, the KV moves, decode instances generate.

    first_token_on: 'prefill' (the prefill instance samples the first token, as DistServe and vLLM) or
    'decode' (it runs the last prompt token, as this project's speculative-decoding-safe hand-off).
    router: where a request goes first. 'prefill': to the least-loaded prefill instance, its decode
    instance chosen when the KV leaves (DistServe). 'decode': to the least-loaded decode instance, which
    forwards it to a prefill instance between its steps, so a request arriving mid-step waits for the
    step to end (this project's workers, and Dynamo's); only then can a decode instance prefill a short
    missing rest itself (local_prefill_max_tokens). follow, concurrency, policy: as simulate_colocated
    (the policy picks the decode instance under router='decode'; its workers are named decode-<n> and
    prefill-<n> by their index in decode and prefill).

    planner: elastic roles (deployment.planner), with slo (TTFT s, TPOT s): the real deployment's
    Planner on the simulated clock moves instances between the roles, as the real driver does: a decode
    instance hands its requests back at its next step boundary (each is fetched again, prompt and outputs
    so far, through a prefill instance, to another decode instance; KV on its way to it is fetched again
    when it lands); a prefill instance takes no new prompt and finishes those it has; either then serves
    its new role after switch_s (what the real switch measured) with that role's settings
    (Instance.role_settings). moves: where each move is recorded ({worker, from, to, at, why,
    seconds})."""
    if first_token_on not in ("prefill", "decode"):
        raise ValueError(f"first_token_on must be one of ('prefill', 'decode'), got {first_token_on!r}")
    if router not in ("prefill", "decode"):
        raise ValueError(f"router must be one of ('prefill', 'decode'), got {router!r}")
    elastic = None
    if planner is not None and planner.elastic:
        elastic = (planner, slo, switch_s, moves if moves is not None else [])
    return _run(
        prefill, decode, requests, first_token_on, layerwise, router, follow, concurrency, policy, elastic
    )


def _run(
    front,
    back,
    requests,
    first_token_on,
    layerwise=True,
    router="prefill",
    follow=None,
    concurrency=None,
    policy=None,
    elastic=None,
) -> list[SimRequest]:
    """The event loop. front: colocated or prefill instances; back: decode instances (or none); elastic:
    (PlannerConfig, slo, switch_s, moves) when instances may move between front and back."""
    disagg = bool(back)
    instances = front + back
    front, back = list(front), list(back)  # an elastic deployment's change
    heap: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(t, kind, payload):
        nonlocal seq
        heapq.heappush(heap, (t, seq, kind, payload))
        seq += 1

    for r in requests:
        push(r.arrival, "arrive", r)
    idle = {id(i): True for i in instances}
    inbox = {id(i): [] for i in back}  # router='decode': requests a busy decode instance has yet to forward
    home = {}  # rid -> the decode instance a request was routed to (router='decode')
    homed = {id(i): 0 for i in back}  # requests routed to a decode instance and not landed yet
    pending: list = []  # arrived beyond the concurrency, in order
    busy = 0
    pool = back if disagg else front  # what the policy picks from (router='decode', or colocated)
    # the policy's names: colocated instances by index; disaggregated ones as the real workers are named
    names = {id(inst): n for n, inst in enumerate(pool)}
    if disagg:
        names = {id(inst): f"decode-{n}" for n, inst in enumerate(back)}
        names.update({id(inst): f"prefill-{n}" for n, inst in enumerate(front)})
    by_name = {names[id(inst)]: inst for inst in instances}
    policy = policy or Router([names[id(i)] for i in pool], "least_loaded", cache_pages=0)
    routed: dict = {}  # rid -> the name of the instance in pool its request went to
    clock = [0.0]  # the simulated time, the policy's clock (its admission learns from first tokens)
    policy.clock = lambda: clock[0]
    heard = [-LOAD_EVERY_S]  # when the policy last read the instances' counters (a real worker's Load)
    page_size = instances[0].page_size
    if disagg:
        policy.prefill_workers = [names[id(i)] for i in front]
    planner = None
    leaving: dict = {}  # id(instance) -> the role it moves to, until it serves it
    if elastic is not None:
        planner_config, slo, switch_s, moves = elastic
        planner = Planner(planner_config, slo, clock=lambda: clock[0])

    def pick(r, now) -> Instance | None:
        """The instance the policy picks, or None where its admission refuses r (r.rejected says why)."""
        if now - heard[0] >= LOAD_EVERY_S:  # the Loads the real router would have by now
            heard[0] = now
            for inst in instances:
                tokens, seconds, steps, seqs, decode_s = inst.speed
                load = Load("sim", 0, 0, 0, prefill_tokens=tokens, prefill_s=seconds, decode_steps=steps,
                            decode_seqs=seqs, decode_s=decode_s)  # fmt: skip
                policy.observe_load(names[id(inst)], load)
        n = policy.route(r.rid, r.names(r.context, page_size), r.context, list(policy.workers), admit=True)
        if n is None:
            r.rejected = policy.why
            return None
        routed[r.rid] = n
        return by_name[n]

    def kick(inst, now):
        if idle[id(inst)]:
            idle[id(inst)] = False
            push(now, "step", inst)

    def finished(r, now):
        """r is done: a slot frees (the next pending request goes), and its next turn is due."""
        nonlocal busy
        busy -= 1
        if r.rid in routed:  # the policy believes its instance now caches its prompt and reply
            policy.finished(routed.pop(r.rid), r.rid, r.names(r.prompt + r.generated - 1, page_size))
        if planner is not None and r.rejected is None:
            planner.observe(r.ttft, r.tpot if r.generated > 1 else None)
        nxt = follow(r) if follow is not None and r.rejected is None else None
        if nxt is not None:
            requests.append(nxt)
            push(nxt.arrival, "arrive", nxt)
        if pending:
            busy += 1
            push(now, "route", pending.pop(0))

    def hand_back(inst, now) -> None:
        """A decode instance leaves its role: every request it has or expects is fetched again (prompt
        and outputs so far) for another decode instance, as the real driver resumes them."""
        name = names[id(inst)]
        mine = inst.running + inst.waiting + inst.recompute + inbox[id(inst)]
        inst.running, inst.waiting, inst.recompute, inbox[id(inst)] = [], [], [], []
        inst.kv_used = 0.0
        inst.handed_back += len(mine)
        for r in mine:
            refetch(r, name, now)

    def refetch(r, left, now) -> None:
        r.held, r.computed, r.drafting = 0, 0, 0
        if r.generated:
            r.fetch = r.prompt + r.generated
        policy.moved(r.rid, left)
        if router == "decode":
            target = policy.route(r.rid, r.names(r.context, page_size), r.context, list(policy.workers))
            routed[r.rid] = target
            home[r.rid] = by_name[target]
            homed[id(by_name[target])] += 1
        push(now, "forward", r)

    def plan(now) -> None:
        roles = {names[id(i)]: ("prefill" if i in front else "decode") for i in instances}
        move = planner.decide(roles, policy, busy=bool(leaving))
        if move is None or move[0] not in by_name:
            return
        name, role = move
        inst = by_name[name]
        if sum(1 for r in roles.values() if r == roles[name]) < 2:
            return  # the last of its role stays (as the real fleet refuses)
        leaving[id(inst)] = role
        policy.leave(name)
        moves.append({"worker": name, "from": roles[name], "to": role, "at": now, "why": planner.why})
        kick(inst, now)  # an idle one moves now; a busy one at its next step boundary

    def serve(inst, role, now) -> None:
        """inst serves role from now on."""
        del leaving[id(inst)]
        (back if role == "decode" else front).append(inst)
        for key, value in inst.role_settings.get(role, {}).items():
            setattr(inst, key, value)
        inbox.setdefault(id(inst), [])
        homed.setdefault(id(inst), 0)
        policy.join(names[id(inst)], role)
        for move in moves:
            if move["worker"] == names[id(inst)] and "seconds" not in move:
                move["seconds"] = now - move["at"]

    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        clock[0] = now
        if planner is not None:
            plan(now)
        if kind == "switched":
            serve(payload[0], payload[1], now)
            kick(payload[0], now)
            continue
        if kind == "arrive":
            if concurrency is not None and busy >= concurrency:
                pending.append(payload)
                continue
            busy += 1
            kind = "route"
        if kind == "route" and not disagg:
            inst = pick(payload, now)
            if inst is None:
                finished(payload, now)
                continue
            inst.waiting.append(payload)
            kick(inst, now)
        elif kind == "route" and router == "decode":
            target = pick(payload, now)
            if target is None:
                finished(payload, now)
                continue
            home[payload.rid] = target
            homed[id(target)] += 1
            if idle[id(target)]:
                push(now, "forward", payload)
            else:
                inbox[id(target)].append(payload)
        elif kind == "forward" and router == "decode" and _prefill_locally(home[payload.rid], payload):
            target = home.pop(payload.rid)
            homed[id(target)] -= 1
            target.recompute.append(payload)
            kick(target, now)
        elif kind in ("route", "forward"):
            chosen = policy.prefill_of(payload.rid)  # the policy's pick (router='decode'), as the real one's
            serving = [i for i in front if id(i) not in leaving] or front
            inst = by_name[chosen] if chosen in by_name else min(serving, key=Instance.load)
            inst.waiting.append(payload)
            kick(inst, now)
        elif kind == "first":  # the policy's admission: its prompt is no longer ahead of anyone's
            policy.first_token(payload.rid)
        elif kind == "land":  # KV arrived at a decode instance
            inst, r = payload
            if router == "decode":
                homed[id(inst)] -= 1
            if inst not in back or id(inst) in leaving:  # it left decoding meanwhile: fetched again
                inst.handed_back += 1
                refetch(r, names[id(inst)], now)
                continue
            if inst.waiting or inst.recompute or not _admit_decode(inst, r):
                inst.waiting.append(r)
            else:
                inst.running.append(r)
            kick(inst, now)
        elif kind == "step":
            inst = payload
            role = leaving.get(id(inst))
            if role == "prefill" and inst in back:  # at its step boundary: hands back, then switches
                back.remove(inst)
                hand_back(inst, now)
                push(now + switch_s, "switched", (inst, role))
                idle[id(inst)] = True
                continue
            if role == "decode" and inst in front and not inst.waiting and not inst.running:
                front.remove(inst)  # its prompts are done
                push(now + switch_s, "switched", (inst, role))
                idle[id(inst)] = True
                continue
            if disagg and inst in back:
                for r in inbox[id(inst)]:  # forwarded between steps
                    push(now, "forward", r)
                inbox[id(inst)].clear()
                dt, events = _decode_step(inst)
            else:
                dt, events = _colocated_step(inst, now)
            if dt == 0.0:
                idle[id(inst)] = True
                continue
            dt *= inst.slowdown
            end = now + dt
            prompt_tokens, decoding = inst.last_step
            if prompt_tokens:
                inst.speed[0] += prompt_tokens
                inst.speed[1] += dt
            elif decoding:
                inst.speed[2] += 1
                inst.speed[3] += decoding
                inst.speed[4] += dt
            for r, what in events:
                if what == "refetch":  # preempted on a decode instance: its KV is computed again
                    r.computed, r.fetch = 0, r.prompt + r.generated
                    if router == "decode":
                        home[r.rid] = inst
                        homed[id(inst)] += 1
                    push(end, "forward", r)
                    continue
                if what == "prefill_done":
                    if not disagg:
                        if inst.cache is not None:
                            inst.cache.add(r, r.context, inst.page_size)
                        r.first_token, r.generated = end, 1
                        push(end, "first", r)
                        r.token_times.append(end)
                        if _maybe_finish(inst, r, end):
                            finished(r, end)
                        continue
                    inst.running.remove(r)
                    inst.kv_used -= r.context + r.output
                    if inst.cache is not None:
                        inst.cache.add(r, r.context, inst.page_size)
                    if first_token_on == "prefill" and not r.fetch:
                        r.first_token, r.generated = end, 1
                        push(end, "first", r)
                        r.token_times.append(end)
                    if router == "decode":
                        target = home.pop(r.rid)
                    else:  # DistServe's: the decode instance is chosen now, and looks its cache up now
                        target = min([i for i in back if id(i) not in leaving] or back, key=Instance.load)
                        _lookup_decode(target, r)
                    r.cached = r.skip * target.page_size
                    if r.generated >= r.output:  # one token, sampled on the prefill side: no decode
                        r.done = end
                        if router == "decode":
                            homed[id(target)] -= 1
                        finished(r, end)
                        continue
                    sent = r.context - r.skip * target.page_size  # only what it lacks (the engine
                    r.sent_tokens += sent  # sends whole pages: up to a page more)
                    kv = sent * inst.cost.model.kv_bytes_per_token()
                    links = min(inst.cost.tp, target.cost.tp)
                    layers = inst.cost.model.layers if layerwise else 1
                    x = transfer_time(kv, inst.cost.hw, links, inst.cost.eff, prefill_s=dt, layers=layers)
                    push(end + x, "land", (target, r))
                else:  # ("tokens", n): n new tokens
                    r.generated += what[1]
                    r.token_times += [end] * what[1]
                    if r.first_token is None:
                        r.first_token = end
                        push(end, "first", r)
                    if _maybe_finish(inst, r, end):
                        finished(r, end)
            push(end, "step", inst)
    return requests


def _maybe_finish(inst: Instance, r: SimRequest, t: float) -> bool:
    """r is done when it has all its outputs: its KV is freed (and its pages cached). True if done."""
    if r.generated < r.output:
        return False
    r.done = t
    inst.running.remove(r)
    inst.kv_used -= r.held if r.held else r.prompt + r.output  # a decode instance's, or a colocated one's
    r.held = 0
    if inst.cache is not None:  # the last token sampled has no KV yet
        inst.cache.add(r, r.prompt + r.generated - 1, inst.page_size)
    return True


def _lookup_decode(inst: Instance, r: SimRequest) -> None:
    """A disaggregated request's decode instance looks up what of its prompt it already holds."""
    r.skip = 0
    if inst.cache is not None and not r.fetch:
        r.skip = inst.cache.lookup(r, r.context, inst.page_size)


def _prefill_locally(inst: Instance, r: SimRequest) -> bool:
    """router='decode': r's decode instance looks its cache up; where it lacks at most
    local_prefill_max_tokens (the last token included) it computes them itself (a prefill chunk in its
    next step, nothing sent) and True is returned."""
    _lookup_decode(inst, r)
    have = r.skip * inst.page_size
    if r.fetch or not inst.local_prefill_max_tokens or r.context - have > inst.local_prefill_max_tokens:
        return False
    r.computed, r.cached, r.local = have, have, True
    return True


def _admit_decode(inst: Instance, r: SimRequest) -> bool:
    """Room to finish: r's context plus min(outputs left, reserved_tokens) must fit beside what the
    admitted requests hold (an idle instance takes it whatever its size)."""
    context, left = r.prompt + r.generated, r.output - r.generated
    if inst.reserved_tokens is not None:
        left = min(left, inst.reserved_tokens)
    need = context + max(left, 1)
    if inst.kv_used + need > inst.kv_capacity_tokens and (inst.running or inst.recompute):
        return False
    if inst.cache is not None and r.computed >= r.context and not r.fetch:  # landed: its pages are named
        inst.cache.add(r, r.context, inst.page_size)
    r.held, r.fetch = need, 0
    inst.kv_used += need
    return True


def _admit_waiting_decode(inst: Instance) -> list:
    """Admit preempted requests to recompute first, then landed ones, in order while they fit; returns
    the recomputed ones admitted (each is a prefill chunk in this step)."""
    recompute = []
    while inst.recompute and len(inst.running) < inst.max_seqs and _admit_decode(inst, inst.recompute[0]):
        r = inst.recompute.pop(0)
        inst.running.append(r)
        recompute.append(r)
    while (
        not inst.recompute
        and inst.waiting
        and len(inst.running) < inst.max_seqs
        and _admit_decode(inst, inst.waiting[0])
    ):
        inst.running.append(inst.waiting.pop(0))
    return recompute


def _preempt(inst: Instance, r: SimRequest) -> list:
    """Drop r's KV on its decode instance: recompute it here later, or ('refetch') hand it back."""
    inst.running.remove(r)
    inst.kv_used -= r.held
    r.held = 0
    inst.preemptions += 1
    context = r.prompt + r.generated
    if inst.preemption == "refetch":
        inst.refetched_tokens += context
        return [(r, "refetch")]
    inst.recomputed_tokens += context
    r.computed = 0
    inst.recompute.append(r)
    return []


def _decode_step(inst: Instance) -> tuple[float, list]:
    recompute = _admit_waiting_decode(inst)
    events = []
    for r in [r for r in inst.running[: inst.max_seqs] if r not in recompute]:  # each decode token's slot
        if r.prompt + r.generated + 1 <= r.held:
            continue
        if inst.kv_used + 1 > inst.kv_capacity_tokens:  # past what it holds, and nothing is free
            events += _preempt(inst, r)
            continue
        r.held += 1
        inst.kv_used += 1
    batch = [r for r in inst.running[: inst.max_seqs] if r not in recompute]
    if not batch and not recompute:
        return (1e-9 if events else 0.0), events  # it only preempted: the refetches still go out
    inst.last_step = (sum(r.prompt + r.generated - r.computed for r in recompute), len(batch))
    verify, plain, drafts = _verify_chunks(inst, batch)
    chunks = verify + [(r.prompt + r.generated - r.computed, r.computed) for r in recompute]
    for r in recompute:  # a preempted request's whole context, or a local prefill's missing rest
        r.computed = r.prompt + r.generated
    dt = inst.cost.step_time(
        chunks, [r.prompt + r.generated for r in plain], len(plain) + drafts + len(recompute)
    )
    return dt, events + _decode_events(inst, plain + recompute)


def poisson_requests(rate: float, n: int, prompt: int | np.ndarray, output: int | np.ndarray, seed: int = 0):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    prompts = np.broadcast_to(prompt, n)
    outputs = np.broadcast_to(output, n)
    return [SimRequest(i, float(arrivals[i]), int(prompts[i]), int(outputs[i])) for i in range(n)]


def attainment(requests: list[SimRequest], ttft_s: float | None, tpot_s: float | None) -> float:
    """Percent of requests meeting the SLOs given (None: not checked)."""
    ok = [
        r.done is not None and (ttft_s is None or r.ttft <= ttft_s) and (tpot_s is None or r.tpot <= tpot_s)
        for r in requests
    ]
    return 100.0 * sum(ok) / len(ok)
