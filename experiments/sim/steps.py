"""One instance's step in the simulator (experiments/sim/simulate.py's event loop calls these): what a
colocated or prefill instance schedules and how long it takes (continuous batching, chunked prefill or
whole prompts first), and a decode instance's admission with room to finish, preemption (recompute or
refetch), speculative verify steps and prefix-cache lookups. Each returns its step's duration from the
instance's cost model and the events the loop applies at the step's end.
"""

from __future__ import annotations

from experiments.sim.instance import Instance, SimRequest


def _admit(inst: Instance, need: int) -> bool:
    if inst.kv_used + need > inst.kv_capacity_tokens and inst.running:
        return False
    inst.kv_used += need
    return True


def colocated_step(inst: Instance, now: float) -> tuple[float, list]:
    """Schedule one step; returns (duration, [(request, kind)]) with kind 'prefill_done' | 'token'."""
    budget = inst.budget
    inst.fit_cache()  # what the running requests grew into since the last step
    decode = [r for r in inst.running if r.computed == r.context][: inst.max_seqs]
    chunks, events = [], []
    if inst.chunked or not inst.waiting and not any(r.computed < r.context for r in inst.running):
        budget -= len(decode)
        if inst.step_budget is not None and decode:  # chunk_size: slo, as the engine sizes its steps
            budget = min(budget, inst.step_budget.prompt_tokens(decode_states(decode, now)))
    else:
        decode = []  # a whole-prompt prefill step runs alone
    for r in [r for r in inst.running if r.computed < r.context and r.ready <= now]:
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
            r.cached = r.named = r.computed  # all of it named: it takes no room from the cache
            r.ready = now + inst.cache.take_load_s()  # out of the steps while pages load from below
            if r.ready > now:
                continue
        left = r.context - r.computed
        n = min(left, budget) if inst.chunked else left
        chunks.append((r, n))
        budget -= n
    if not chunks and not decode:
        loading = [r.ready for r in inst.running if r.ready > now]
        inst.last_step = (0, 0)  # a wait for loads: no step
        return (min(loading) - now, []) if loading else (0.0, [])
    inst.last_step = (sum(n for _, n in chunks), len(decode))
    verify, decode, drafts = _verify_chunks(inst, decode)
    sampled = len(decode) + sum(1 for r, n in chunks if r.computed + n == r.context) + drafts
    dt = _priced(
        inst, [(n, r.computed) for r, n in chunks] + verify, [r.prompt + r.generated for r in decode], sampled
    )

    for r, n in chunks:
        r.computed += n
        if r.started is None:
            r.started, r.first_pass = now, dt * inst.slowdown
        r.last_chunk = n
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


def maybe_finish(inst: Instance, r: SimRequest, t: float) -> bool:
    """r is done when it has all its outputs: its KV is freed (and its pages cached). True if done."""
    if r.generated < r.output:
        return False
    r.done = t
    inst.running.remove(r)
    inst.kv_used -= r.held if r.held else r.prompt + r.output  # a decode instance's, or a colocated one's
    r.held = r.named = 0
    if inst.cache is not None:  # the last token sampled has no KV yet
        inst.fit_cache()
        inst.cache.add(r, r.prompt + r.generated - 1, inst.page_size)
    return True


def lookup_decode(inst: Instance, r: SimRequest, now: float = 0.0, transfer_s: float = 0.0) -> None:
    """A disaggregated request's decode instance looks up what of its prompt it already holds: on its
    device, and below it as its tiers' decode_loads allow ("cost": the leading pages whose loads add up
    to at most transfer_s, the time the rest is expected to take to arrive). Pages below load from now:
    r cannot join a step before r.ready."""
    r.skip = 0
    if inst.cache is None or r.fetch:
        return
    tiers = inst.cache.tiers
    mode = tiers.decode_loads if tiers is not None else "never"
    within = {"never": 0.0, "always": None, "cost": transfer_s}[mode]
    r.skip = inst.cache.lookup(r, r.context, inst.page_size, within_s=within)
    r.named = r.skip * inst.page_size
    r.ready = now + inst.cache.take_load_s()


def prefill_locally(inst: Instance, r: SimRequest, now: float = 0.0, transfer_s: float = 0.0) -> bool:
    """router='decode': r's decode instance looks its cache up (lookup_decode); where it lacks at most
    local_prefill_max_tokens (the last token included) it computes them itself (prefill chunks in its
    next steps, decode_step's; nothing sent) and True is returned."""
    lookup_decode(inst, r, now, transfer_s)
    have = r.skip * inst.page_size
    if r.fetch or not inst.local_prefill_max_tokens or r.context - have > inst.local_prefill_max_tokens:
        return False
    prefill_here(inst, r)
    return True


def prefill_here(inst: Instance, r: SimRequest) -> None:
    """r (looked up: lookup_decode) is computed on its decode instance from what its cache holds."""
    have = r.skip * inst.page_size
    r.computed, r.cached, r.local = have, have, True


def admit_decode(inst: Instance, r: SimRequest) -> bool:
    """Room to finish: r's context plus min(outputs left, reserved_tokens) must fit beside what the
    admitted requests hold (an idle instance takes it whatever its size)."""
    context, left = r.prompt + r.generated, r.output - r.generated
    if inst.reserved_tokens is not None:
        left = min(left, inst.reserved_tokens)
    need = context + max(left, 1)
    if inst.kv_used + need > inst.kv_capacity_tokens and (inst.running or inst.recompute):
        return False
    landed = inst.cache is not None and r.computed >= r.context and not r.fetch  # its pages are named
    r.held, r.fetch = need, 0
    inst.kv_used += need
    if landed:
        r.named = r.context
        inst.fit_cache()
        inst.cache.add(r, r.context, inst.page_size)
    return True


def _admit_waiting_decode(inst: Instance) -> None:
    """Admit preempted requests to recompute (and local prefills) first, then landed ones, in order while
    they fit; the ones to compute join running with their context not yet computed."""
    while inst.recompute and len(inst.running) < inst.max_seqs and admit_decode(inst, inst.recompute[0]):
        r = inst.recompute.pop(0)
        r.computing = True
        inst.running.append(r)
    while (
        not inst.recompute
        and inst.waiting
        and len(inst.running) < inst.max_seqs
        and admit_decode(inst, inst.waiting[0])
    ):
        inst.running.append(inst.waiting.pop(0))


def _preempt(inst: Instance, r: SimRequest) -> list:
    """Drop r's KV on its decode instance: recompute it here later, or ('refetch') hand it back."""
    inst.running.remove(r)
    inst.kv_used -= r.held
    r.held = r.named = 0
    inst.preemptions += 1
    context = r.prompt + r.generated
    if inst.preemption == "refetch":
        inst.refetched_tokens += context
        return [(r, "refetch")]
    inst.recomputed_tokens += context
    r.computed, r.started = 0, None
    inst.recompute.append(r)
    return []


def decode_states(requests: list, now: float) -> list:
    """engine.budget.decode_state of each decoding request, on the simulated clock."""
    from engine.budget import decode_state  # here: the simulator imports without torch otherwise

    return [decode_state(r.token_times, now, r.output - r.generated - 1) for r in requests]


def decode_step(inst: Instance, now: float) -> tuple[float, list]:
    """One step of a decode instance: a token for each decoding request, and chunks of what it computes
    itself (a preempted request's context, a local prefill's missing rest) under its token budget, with
    chunk_size: slo under the TPOT budget too, as the engine's scheduler sizes them; such a request
    samples its next token with its last chunk."""
    _admit_waiting_decode(inst)
    inst.fit_cache()
    events = []
    running = inst.running[: inst.max_seqs]
    computing = [r for r in running if r.computing]
    for r in [r for r in running if not r.computing]:  # each decode token's slot
        if r.prompt + r.generated + 1 <= r.held:
            continue
        if inst.kv_used + 1 > inst.kv_capacity_tokens:  # past what it holds, and nothing is free
            events += _preempt(inst, r)
            continue
        r.held += 1
        inst.kv_used += 1
    batch = [r for r in inst.running[: inst.max_seqs] if not r.computing]
    budget = inst.budget - len(batch)
    if inst.step_budget is not None and batch:
        budget = min(budget, inst.step_budget.prompt_tokens(decode_states(batch, now)))
    chunks = []
    for r in computing:
        if budget <= 0:
            break
        n = min(r.prompt + r.generated - r.computed, budget)
        chunks.append((r, n))
        budget -= n
    if not batch and not chunks:
        return (1e-9 if events else 0.0), events  # it only preempted: the refetches still go out
    inst.last_step = (sum(n for _, n in chunks), len(batch))
    verify, plain, drafts = _verify_chunks(inst, batch)
    done = []
    for r, n in chunks:
        r.computed += n
        if r.computed == r.prompt + r.generated:
            r.computing = False
            done.append(r)
    dt = _priced(
        inst,
        verify + [(n, r.computed - n) for r, n in chunks],
        [r.prompt + r.generated for r in plain],
        len(plain) + drafts + len(done),
    )
    return dt, events + _decode_events(inst, plain + done)


def _priced(inst: Instance, chunks: list, kv_lens: list[int], sampled: int) -> float:
    """The step's time alone (the cost model's); with a model of the machine's neighbours, also what it
    reads (Instance.last_bytes: the simulation prices its neighbours' cost with it)."""
    if inst.contention is not None:
        inst.last_bytes = inst.cost.step_bytes(chunks, kv_lens, sampled)
    return inst.cost.step_time(chunks, kv_lens, sampled)
