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
either recomputed on the decode instance (prefill chunks in its next steps, under its token budget and,
with chunk_size: slo, its SloBudget, as a local prefill's missing rest) or refetched from a prefill
instance (prompt + outputs so far). reserved_tokens=0 is the old rule (the prompt's KV only), which
thrashes once the decode instance fills.

Prefix caching (an instance's `cache`, a PageCache; the request, cache and instance types are in
experiments/sim/instance.py): a request's KV is a row of pages of `page_size` tokens, named by what they
hold: the first `shared` tokens are common to every request (a system prompt), the rest belong to its
`stream` (a conversation: turn t+1's prompt is turn t's prompt, reply and a new message, so its pages are
named as turn t's were). A colocated or prefill instance computes a request from its longest cached
prefix on (its last token always); pages are named when its prefill ends and, for the instance that
decodes it, when it finishes (the reply's pages too, as the engine names them while decoding). A
disaggregated request first looks up its decode instance's cache (below its device cache too, as its
tiers' decode_loads allow: it joins a step once those loads land; a decode instance puts nothing into the
shared pool): the prefill instance sends only the pages from there on, or, where what is missing is at
most `local_prefill_max_tokens`, the decode instance computes it itself (in chunks, as above). Each cache
is an LRU over page names sharing the instance's KV capacity with its running requests, as the engine's
one allocator: it holds what their computed KV leaves (their named pages counted once, in the cache),
its least recently used names leaving as they grow (Instance.fit_cache), a request's tail before its
head (the engine frees a request's pages last first); admission still reserves each request's context
and outputs beside the others' (the engine reserves less under pressure, fair_share, and may preempt).
A preempted request's pages are not kept (its refetch or recompute looks nothing up).

Output per request: arrival, first-token time and the time of each later token, from which the same
metrics as the real runs follow (experiments/metrics.py's percentiles and SLO rules).
"""

from __future__ import annotations

import heapq

import numpy as np

from experiments.sim.cost import transfer_time
from experiments.sim.elastic import hand_back, plan, serve
from experiments.sim.instance import Instance, SimRequest
from experiments.sim.steps import (
    admit_decode,
    colocated_step,
    decode_step,
    lookup_decode,
    maybe_finish,
    prefill_here,
    prefill_locally,
)
from serving.messages import LOAD_EVERY_S, Load
from serving.router.planner import Planner, PlannerConfig
from serving.router.policy import Router


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
    sim = _Simulation(front, back, requests, first_token_on, layerwise, router, follow, concurrency, policy)
    if elastic is not None:
        planner_config, slo, switch_s, sim.moves = elastic
        sim.planner, sim.switch_s = Planner(planner_config, slo, clock=lambda: sim.clock), switch_s
    return sim.run()


class _Simulation:
    """One simulated run: the event heap (time, seq, kind, payload) and what each instance holds."""

    def __init__(self, front, back, requests, first_token_on, layerwise, router, follow, concurrency, policy):
        self.disagg = bool(back)
        self.instances = front + back
        self.front, self.back = list(front), list(back)  # an elastic deployment's change
        self.requests, self.first_token_on, self.layerwise = requests, first_token_on, layerwise
        self.router, self.follow, self.concurrency = router, follow, concurrency
        self.heap: list = []
        self.seq = 0
        self.idle = {id(i): True for i in self.instances}
        self.stepping: dict = {}  # id(instance) -> (end, kind) of its last step (with contention)
        self.inbox = {id(i): [] for i in back}  # router='decode': what a busy decode instance forwards next
        self.home = {}  # rid -> the decode instance a request was routed to (router='decode')
        self.homed = {id(i): 0 for i in back}  # requests routed to a decode instance and not landed yet
        self.pending: list = []  # arrived beyond the concurrency, in order
        self.busy = 0
        pool = back if self.disagg else front  # what the policy picks from (router='decode', or colocated)
        # the policy's names: colocated instances by index; disaggregated ones as the real workers are named
        self.names = {id(inst): n for n, inst in enumerate(pool)}
        if self.disagg:
            self.names = {id(inst): f"decode-{n}" for n, inst in enumerate(back)}
            self.names.update({id(inst): f"prefill-{n}" for n, inst in enumerate(front)})
        self.by_name = {self.names[id(inst)]: inst for inst in self.instances}
        self.policy = policy or Router([self.names[id(i)] for i in pool], "least_loaded", cache_pages=0)
        self.routed: dict = {}  # rid -> the name of the instance in pool its request went to
        self.clock = 0.0  # the simulated time, the policy's clock (its admission learns from first tokens)
        self.policy.clock = lambda: self.clock
        self.heard = -LOAD_EVERY_S  # when the policy last read the instances' counters (a worker's Load)
        self.page_size = self.instances[0].page_size
        if self.disagg:
            self.policy.prefill_workers = [self.names[id(i)] for i in front]
        self.planner, self.switch_s, self.moves = None, 0.0, []
        self.leaving: dict = {}  # id(instance) -> the role it moves to, until it serves it
        for inst in back:  # a decode instance puts nothing into the pool, as the engine (kv_tiers' share)
            if inst.cache is not None:
                inst.cache.share = False
        for r in requests:
            self.push(r.arrival, "arrive", r)

    def push(self, t, kind, payload):
        heapq.heappush(self.heap, (t, self.seq, kind, payload))
        self.seq += 1

    def run(self) -> list[SimRequest]:
        while self.heap:
            now, _, kind, payload = heapq.heappop(self.heap)
            self.clock = now
            if self.planner is not None and self.planner.due():
                plan(self, now)
            if kind == "switched":
                serve(self, payload[0], payload[1], now)
                self.kick(payload[0], now)
            elif kind == "step":
                self.step(payload, now)
            elif kind == "cached":
                inst, r, tokens = payload
                if any(x is r for x in inst.running):  # its pages, held, are named now: no more room
                    r.named = max(r.named, tokens)
                    inst.fit_cache()
                inst.cache.add(r, tokens, inst.page_size)
            else:
                self.request_event(kind, payload, now)
        return self.requests

    def request_event(self, kind, payload, now) -> None:
        """A request arrives, is routed, forwarded to a prefill instance, at its first token, or lands."""
        router = self.router
        if kind == "arrive":
            if self.concurrency is not None and self.busy >= self.concurrency:
                self.pending.append(payload)
                return
            self.busy += 1
            kind = "route"
        if kind == "route" and not self.disagg:
            inst = self.pick(payload, now)
            if inst is None:
                self.finished(payload, now)
                return
            inst.waiting.append(payload)
            self.kick(inst, now)
        elif kind == "route" and router == "decode":
            target = self.pick(payload, now)
            if target is None:
                self.finished(payload, now)
                return
            self.home[payload.rid] = target
            self.homed[id(target)] += 1
            if self.idle[id(target)]:
                self.push(now, "forward", payload)
            else:
                self.inbox[id(target)].append(payload)
        elif (
            kind == "forward"
            and router == "decode"
            and (
                prefill_locally(self.home[payload.rid], payload, now, self.expected_prefill_s(payload))
                or self.by_load(payload)
            )
        ):
            target = self.home.pop(payload.rid)
            self.homed[id(target)] -= 1
            self.push(max(now, payload.ready), "local", (target, payload))  # once its loads have landed
        elif kind == "local":  # prefilled on its decode instance, from what it holds there
            target, r = payload
            target.recompute.append(r)
            self.kick(target, now)
        elif kind in ("route", "forward"):
            chosen = self.policy.prefill_of(
                payload.rid
            )  # the policy's pick (router='decode'), as the real one's
            serving = [i for i in self.front if id(i) not in self.leaving] or self.front
            inst = self.by_name[chosen] if chosen in self.by_name else min(serving, key=Instance.load)
            inst.waiting.append(payload)
            self.kick(inst, now)
        elif kind == "first":  # the policy's admission: its prompt is no longer ahead of anyone's
            self.policy.first_token(payload.rid)
        elif kind == "land":  # KV arrived at a decode instance
            self.land(*payload, now)

    def expected_prefill_s(self, r) -> float:
        """How long r's KV is expected to take to arrive when sent, as a decode worker's messenger expects
        (kv_tiers.decode_loads: cost): the prompt tokens queued at the least loaded prefill instance and
        r's own, at the prefill instances' measured seconds per prompt token (the cost model's until they
        have one)."""
        serving = [i for i in self.front if id(i) not in self.leaving] or self.front
        queued = min(sum(q.context - q.computed for q in i.waiting + i.running) for i in serving)
        tokens = sum(i.speed[0] for i in serving)
        per_token = (
            sum(i.speed[1] for i in serving) / tokens
            if tokens
            else serving[0].cost.prefill_time([r.context]) / r.context
        )
        return (queued + r.context) * per_token

    def by_load(self, r) -> bool:
        """The policy sent r to be prefilled on its own decode instance (deployment.local_prefill_by_load:
        its prefill instances' queue would make it late), as the real decode worker takes a Submit naming
        itself."""
        home = self.home[r.rid]
        if r.fetch or self.policy.prefill_of(r.rid) != self.names[id(home)]:
            return False
        prefill_here(home, r)
        return True

    def land(self, inst, r, now) -> None:
        if r.ready > now:  # what it loads from below has not landed yet: it joins once that has
            self.push(r.ready, "land", (inst, r))
            return
        if self.router == "decode":
            self.homed[id(inst)] -= 1
        if inst not in self.back or id(inst) in self.leaving:  # it left decoding meanwhile: fetched again
            inst.handed_back += 1
            self.refetch(r, self.names[id(inst)], now)
            return
        if inst.waiting or inst.recompute or not admit_decode(inst, r):
            inst.waiting.append(r)
        else:
            inst.running.append(r)
        self.kick(inst, now)

    def step(self, inst, now) -> None:
        """inst's step boundary: a move it makes, or its next step and what that step did."""
        role = self.leaving.get(id(inst))
        if (
            role is not None and role.sends_kv and inst in self.back
        ):  # at its step boundary: hands back, then switches
            self.back.remove(inst)
            hand_back(self, inst, now)
            self.push(now + self.switch_s, "switched", (inst, role))
            self.idle[id(inst)] = True
            return
        if (
            role is not None
            and role.receives_kv
            and inst in self.front
            and not inst.waiting
            and not inst.running
        ):
            self.front.remove(inst)  # its prompts are done
            self.push(now + self.switch_s, "switched", (inst, role))
            self.idle[id(inst)] = True
            return
        if self.disagg and inst in self.back:
            for r in self.inbox[id(inst)]:  # forwarded between steps
                self.push(now, "forward", r)
            self.inbox[id(inst)].clear()
            dt, events = decode_step(inst, now)
        else:
            dt, events = colocated_step(inst, now)
        if dt == 0.0:
            self.idle[id(inst)] = True
            return
        dt *= inst.slowdown
        prompt_tokens, decoding = inst.last_step
        if inst.contention is not None and (prompt_tokens or decoding):  # a step (not a wait for loads)
            dt *= self.beside(inst, now, dt)
            self.stepping[id(inst)] = (now + dt, "prefill" if prompt_tokens else "decode")
        end = now + dt
        if inst.step_budget is not None:  # the budget learns the step times, as the engine's does
            inst.step_budget.observe(decoding, prompt_tokens, dt)
        if prompt_tokens:
            inst.speed[0] += prompt_tokens
            inst.speed[1] += dt
        elif decoding:
            inst.speed[2] += 1
            inst.speed[3] += decoding
            inst.speed[4] += dt
        for r, what in events:
            if what == "refetch":  # preempted on a decode instance: its KV is computed again
                r.computed, r.fetch, r.started = 0, r.prompt + r.generated, None
                if self.router == "decode":
                    self.home[r.rid] = inst
                    self.homed[id(inst)] += 1
                self.push(end, "forward", r)
            elif what == "prefill_done":
                self.prefilled(inst, r, end, dt)
            else:  # ("tokens", n): n new tokens
                r.generated += what[1]
                r.token_times += [end] * what[1]
                if r.first_token is None:
                    r.first_token = end
                    self.push(end, "first", r)
                if maybe_finish(inst, r, end):
                    self.finished(r, end)
        self.push(end, "step", inst)

    def beside(self, inst, now: float, dt: float) -> float:
        """How many times its time alone inst's step from now takes beside the other instances' steps on
        the machine (Instance.contention): each busy neighbour counts by the kind of the step it is in,
        for the whole step where it has more to do after that one, else for the share of it left."""
        shares: dict[str, float] = {}
        for other in self.instances:
            end, kind = self.stepping.get(id(other), (0.0, ""))
            if other is inst or end <= now:
                continue
            more = bool(other.running or other.waiting)
            shares[kind] = shares.get(kind, 0.0) + (1.0 if more else min(1.0, (end - now) / dt))
        if not shares:
            return 1.0
        return inst.contention.factor(inst.contention.share(inst.last_bytes, dt), shares)

    def cached(self, inst, r, end, tokens: int) -> None:
        """r's first `tokens` tokens' pages join inst's prefix cache (and the pool) when its step ends,
        not when the step is scheduled: a request that arrives meanwhile must not find KV still being
        computed."""
        if inst.cache is not None:
            self.push(end, "cached", (inst, r, tokens))

    def prefilled(self, inst, r, end, dt) -> None:
        """r's prompt is computed on inst (a step of dt that ended at end): colocated, its first token;
        disaggregated, its KV leaves for its decode instance."""
        if not self.disagg:
            self.cached(inst, r, end, r.context)
            r.first_token, r.generated = end, 1
            self.push(end, "first", r)
            r.token_times.append(end)
            if maybe_finish(inst, r, end):
                self.finished(r, end)
            return
        inst.running.remove(r)
        inst.kv_used -= r.context + r.output
        # a prefill worker whose decode worker samples the first token is given the prompt without its
        # last token (which the decode worker runs): a page that token would fill is not named here
        self.cached(inst, r, end, r.context - (self.first_token_on == "decode"))
        if self.first_token_on == "prefill" and not r.fetch:
            r.first_token, r.generated = end, 1
            self.push(end, "first", r)
            r.token_times.append(end)
        if self.router == "decode":
            target = self.home.pop(r.rid)
        else:  # DistServe's: the decode instance is chosen now, and looks its cache up now
            target = min([i for i in self.back if id(i) not in self.leaving] or self.back, key=Instance.load)
            kv = r.context * inst.cost.model.kv_bytes_per_token()
            lookup_decode(target, r, end, transfer_time(kv, inst.cost.hw, 1, inst.cost.eff))
        r.cached = r.skip * target.page_size
        if r.generated >= r.output:  # one token, sampled on the prefill side: no decode
            r.done = end
            if self.router == "decode":
                self.homed[id(target)] -= 1
            self.finished(r, end)
            return
        sent = r.context - r.skip * target.page_size  # only what it lacks (the engine
        r.sent_tokens += sent  # sends whole pages: up to a page more)
        kv = sent * inst.cost.model.kv_bytes_per_token()
        links = min(inst.cost.tp, target.cost.tp)
        total = transfer_time(kv, inst.cost.hw, links, inst.cost.eff)
        if self.layerwise:  # each layer's pages leave as each pass computes them, the link in turn
            layers = inst.cost.model.layers
            first = (end - dt, dt) if r.started is None else (r.started, r.first_pass)
            begin = first[0] + first[1] / layers  # the first pass's first layer is computed
            last = total * min(r.last_chunk or sent, sent) / max(sent, 1) / layers  # the last pass's last
            landed = max(max(begin, inst.link_free) + total, end + last)
        else:  # all of it once the prefill is computed
            landed = max(end, inst.link_free) + total
        inst.link_free = landed  # its NICs send one request's pages after another's
        r.started = None
        self.push(landed, "land", (target, r))

    def pick(self, r, now) -> Instance | None:
        """The instance the policy picks, or None where its admission refuses r (r.rejected says why)."""
        policy = self.policy
        if now - self.heard >= LOAD_EVERY_S:  # the Loads the real router would have by now
            self.heard = now
            for inst in self.instances:
                tokens, seconds, steps, seqs, decode_s = inst.speed
                load = Load("sim", 0, 0, 0, prefill_tokens=tokens, prefill_s=seconds, decode_steps=steps,
                            decode_seqs=seqs, decode_s=decode_s)  # fmt: skip
                policy.observe_load(self.names[id(inst)], load)
        n = policy.route(
            r.rid, r.names(r.context, self.page_size), r.context, list(policy.workers), admit=True
        )
        if n is None:
            r.rejected = policy.why
            return None
        self.routed[r.rid] = n
        return self.by_name[n]

    def kick(self, inst, now):
        if self.idle[id(inst)]:
            self.idle[id(inst)] = False
            self.push(now, "step", inst)

    def finished(self, r, now):
        """r is done: a slot frees (the next pending request goes), and its next turn is due."""
        self.busy -= 1
        if r.rid in self.routed:  # the policy believes its instance now caches its prompt and reply
            self.policy.finished(
                self.routed.pop(r.rid), r.rid, r.names(r.prompt + r.generated - 1, self.page_size)
            )
        if self.planner is not None and r.rejected is None:
            self.planner.observe(r.ttft, r.tpot if r.generated > 1 else None)
        nxt = self.follow(r) if self.follow is not None and r.rejected is None else None
        if nxt is not None:
            self.requests.append(nxt)
            self.push(nxt.arrival, "arrive", nxt)
        if self.pending:
            self.busy += 1
            self.push(now, "route", self.pending.pop(0))

    def refetch(self, r, left, now) -> None:
        r.held, r.computed, r.drafting, r.computing, r.named = 0, 0, 0, False, 0
        if r.generated:
            r.fetch = r.prompt + r.generated
        self.policy.moved(r.rid, left)
        if self.router == "decode":
            target = self.policy.route(
                r.rid, r.names(r.context, self.page_size), r.context, list(self.policy.workers)
            )
            self.routed[r.rid] = target
            self.home[r.rid] = self.by_name[target]
            self.homed[id(self.by_name[target])] += 1
        self.push(now, "forward", r)


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
