"""Which decode (or colocated) worker takes a request: one Router for the runtime (the server's and the
main job's) and the simulator.

Policies (`deployment.routing`):
- `round_robin`: the live workers in turn (and, disaggregated, the live prefill workers in turn).
- `least_loaded`: the one with the fewest requests in flight.
- `cache_aware` (default): the lowest cost = overlap_weight x the pages it would have to compute (the
  request's pages minus the leading ones the router believes that worker caches) + the pages of the
  requests it already has in flight (Dynamo's KV router's cost, in pages; SGLang's cache-aware router
  keeps the same kind of approximate index). Ties go to the fewest in flight, then the first worker.
  With KV tiers (kv_tiers), a leading page below the worker's device memory (its host pool or files,
  or the shared pool) counts at its price: its load time over its compute time (serving/
  below.py), so a worker that can load a history beats one that must compute it.

A worker of DP groups (deployment.dp or decode_dp > 1, engine/dp.py) is dp schedulers behind one
endpoint: the router picks the worker as above (its cache the union of its groups', its load all their
requests), then the group in it with the same cost over each group's own cache belief and requests
(Groups; the worker's Load reports each group's cache events), and the worker hands the request to that
group (dp_rank).

What a worker caches is the router's belief: the pages of every prompt it routed there (at once, before
the worker has computed them), and what the worker reports, batched in its Load about once a second:
each page it named and each name it dropped (Dynamo's KV events; observe()), with names computed as the
engine's (its salt: model, dtype, page size, from the worker's Ready); an LRU per worker as large as
the worker's cache. Without events (a simulator, a run whose workers do not send them) a request's end
adds its reply's pages. A worker that dies forgets all of it. A belief that is stale costs only speed:
the worker looks its own cache up and computes what it lacks.

A disaggregated request's prefill worker is the router's choice too (prefill_of(); the decode worker
asks it unless it is down there): the live one where its prompt would be done soonest, the prompt tokens
routed to each and not yet at their first token plus the ones of this prompt it lacks (its own believed
cache: the decode worker's does not spare it computing them) over its speed (round_robin: in turn).

Admission (`deployment.admission`): `none` takes every request; `slo` refuses at once a request the
router predicts will miss the SLO anyway (Mooncake's early rejection), instead of spending prefill time
on it and on the requests behind it:
- TTFT = the prompt tokens ahead of it (routed, not yet at their first token, on its colocated worker or
  its chosen prefill worker) plus its own not-cached tokens, over that worker's prefill speed as it
  measures it (its Loads: prompt tokens over the time of the steps that computed them), plus a learned
  bias (the mean of what the first tokens of the last BIAS_WINDOW_S took beyond that prediction; for a
  worker with nothing in flight, of those that came with nothing else on their worker);
- TPOT = the decode step time at the batch it would join (least squares of step time on batch over the
  worker's recent Loads).
A worker's speed starts from what it timed on dummy passes as it started (its Ready: engine
LLM.measure_speed), and its Loads' measurements take over as they come (admitting on a speed not yet
measured, the router let 5 of the first 6 requests of an overloaded run miss the TTFT SLO by up to 2x).
A worker that timed nothing (TP, DP) borrows a measured peer's speed, and with none the router admits.
It cannot lock itself out: a refused request never yields a first token, so refusals alone would leave
a bias (or a slow decode step) in place for good. Evidence therefore expires (a first token counts for
BIAS_WINDOW_S), and while the router refuses everything it still admits one request per probe interval
(slo.ttft_s, within [PROBE_MIN_S, PROBE_MAX_S]) to measure the deployment again: never one that needs
more KV pages than a worker holds, which is refused every time.
`refusing` says how long it has refused every new request (GET /health, /metrics).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable

from engine.role import Role
from serving.router.belief import Groups, Speed, apply_events, leading, page_names
from serving.router.below import Below

POLICIES = ("round_robin", "least_loaded", "cache_aware")
BIAS_WINDOW_S = 20.0  # a first token's lateness (and a decode step's time) counts this long
BIAS_SAMPLES = 64  # and only the most recent this many
PROBE_MIN_S, PROBE_MAX_S = 0.5, 10.0  # while all is refused, one is admitted every slo.ttft_s in these
ADMISSIONS = ("none", "slo")
CANNOT_FIT = "rejected: it cannot fit"  # a refusal whatever the load (what _admit says starts with it)
ROLES = (Role.PREFILL, Role.DECODE)  # an elastic worker's (Role.switchable)


class Router:
    """in_flight: worker -> the requests it has (the callers' one record of where each request is)."""

    def __init__(
        self,
        workers: Iterable[str],
        policy: str = "cache_aware",
        overlap_weight: float = 1.0,
        cache_pages: int = 512,
        page_size: int = 16,
        salt: bytes = b"",
        admission: str = "none",
        slo: tuple[float, float] = (float("inf"), float("inf")),
        prefill_workers: Iterable[str] = (),
        clock: Callable[[], float] = time.perf_counter,
        by_load: bool = False,
        dp: int = 1,
    ):
        """admission, slo (TTFT s, TPOT s): early rejection; prefill_workers: a disaggregated deployment's
        (their speed is the prefill speed); clock: what first_token() times against; by_load: a decode
        worker prefills a request itself when its prefill worker's queue would break the TTFT SLO
        (deployment.local_prefill_by_load: _by_load); dp: each routed worker's DP groups (deployment.dp or
        decode_dp), among which the router picks one for each request (dp_rank_of)."""
        if policy not in POLICIES:
            raise ValueError(f"deployment.routing={policy!r} is not allowed: one of {POLICIES}")
        if admission not in ADMISSIONS:
            raise ValueError(f"deployment.admission={admission!r} is not allowed: one of {ADMISSIONS}")
        self.admission, self.slo, self.clock = admission, slo, clock
        self.prefill_workers = list(prefill_workers)
        self.prefill_live: set = set()  # prefill workers up (a Ready or a Load) and not dead since
        self.speed: dict[str, Speed] = {}  # worker (prefill ones too) -> what its Loads measured
        # request -> (worker, its prompt tokens to compute, when, predicted TTFT, the worker it runs on)
        self.waiting: dict = {}
        # (when, first token's time beyond its prediction, whether others were on its worker then)
        self.late: deque = deque(maxlen=BIAS_SAMPLES)
        self.rejected = self.probes = 0
        self.by_load, self.local_by_load = by_load, 0  # ... and how many it sent to prefill locally
        self.admitted_at: float | None = None  # when it last admitted a new request (None: not yet)
        self.refusing_since: float | None = None  # the first refusal since then (None: it admitted last)
        self.why: str | None = None  # why the last route() refused its request
        self.policy, self.overlap_weight = policy, overlap_weight
        self.cache_pages, self.page_size, self.salt = cache_pages, page_size, salt
        self.events = 0  # cache events observed (stored and dropped names)
        self.workers = list(workers)
        self.in_flight: dict[str, set] = {w: set() for w in self.workers}
        # its belief of each worker's cache: the routed ones', and a prefill worker's once it has prompts
        self.cached: dict[str, OrderedDict] = {w: OrderedDict() for w in self.workers}
        self._pages: dict = {}  # request -> pages of its prompt (the load it adds)
        self._turn = self._prefill_turn = 0  # round_robin's next worker, and next prefill worker
        self.routed_pages = self.overlap_pages = 0  # what it routed, and found cached where it went
        self.below = Below(page_size)  # what sits below each worker's device pages, and its price
        self.dp = dp
        self.groups: dict[str, Groups] = {w: Groups(dp, cache_pages) for w in self.workers} if dp > 1 else {}
        self._group: dict = {}  # request -> its group on its worker (dp > 1)

    @classmethod
    def of(
        cls,
        deployment,
        workers: Iterable[str],
        cache_pages: int,
        page_size: int,
        salt: bytes = b"",
        slo=None,
        prefill_workers: Iterable[str] = (),
        dp: int = 1,
    ) -> Router:
        """The router a DeploymentConfig asks for (salt: the workers' page names', from their Ready; slo:
        an SloConfig, for admission=slo; dp: the routed workers' DP groups)."""
        w = deployment.routing_overlap_weight
        bounds = (slo.ttft_s, slo.tpot_s) if slo is not None else (float("inf"), float("inf"))
        return cls(
            workers,
            deployment.routing,
            w,
            cache_pages,
            page_size,
            salt,
            deployment.admission,
            bounds,
            prefill_workers,
            by_load=deployment.local_prefill_by_load,
            dp=dp,
        )

    def route_tokens(
        self,
        request_id,
        token_ids,
        live: list[str],
        admit: bool = False,
        cache_salt: str | None = None,
        sequences: int = 1,
        max_tokens: int = 0,
    ) -> str | None:
        """route() for a real request: its tokens (prompt, and any outputs it resumes after). admit: a
        new request, which admission=slo may refuse (None; `why` says why); a migrated one is not."""
        names = page_names(token_ids, self.page_size, self.salt, cache_salt)
        return self.route(request_id, names, len(token_ids), live, admit, sequences, max_tokens)

    # -- admission

    def observe_load(self, worker: str, load) -> None:
        """A worker's Load: its cache events (each DP group's too), and the counters its speed comes from."""
        self.observe(worker, load.cache_events)
        groups = self.groups.get(worker)
        if groups is not None:
            for g, events in enumerate(load.group_cache_events[: self.dp]):
                groups.observe(g, events)
        self.below.observe(worker, load.tier_events)
        counters = (load.prefill_tokens, load.prefill_s, load.decode_steps, load.decode_seqs, load.decode_s)
        speed = self.speed.setdefault(worker, Speed())
        speed.observe(counters, self.clock())
        self.below.observe_load(worker, load.kv_tiers, speed.prefill_tok_s)
        if worker in self.prefill_workers:  # it talks: requests may go to it
            self.prefill_live.add(worker)

    @property
    def ttft_bias(self) -> float:
        """The mean of what the first tokens of the last BIAS_WINDOW_S took beyond their prediction (0
        without any: old lateness is no evidence that the deployment is late now)."""
        now = self.clock()
        while self.late and now - self.late[0][0] > BIAS_WINDOW_S:
            self.late.popleft()
        return sum(e for _, e, _ in self.late) / len(self.late) if self.late else 0.0

    def _bias(self, target: str, queue: str | None) -> float:
        """ttft_bias as it applies to a request for target joining queue: while nothing is in flight
        there, only the lateness of first tokens that came with nothing else on their worker (what a
        burst's requests took behind each other says nothing of an idle worker: after one, an idle
        server refused every request for about 20 s)."""
        mean = self.ttft_bias  # drops what is past the window
        if self.in_flight.get(target) or (queue is not None and self._ahead(queue)):
            return max(mean, 0.0)
        alone = [e for _, e, busy in self.late if not busy]
        return max(sum(alone) / len(alone), 0.0) if alone else 0.0

    @property
    def probe_s(self) -> float:
        """While every new request is refused, one is admitted this often (to measure again)."""
        return min(max(self.slo[0], PROBE_MIN_S), PROBE_MAX_S)

    @property
    def refusing(self) -> float | None:
        """Seconds for which the router has refused every new request (None: it admitted the last one)."""
        return None if self.refusing_since is None else self.clock() - self.refusing_since

    def predict(self, target: str, tokens: int) -> tuple[float | None, float | None]:
        """(TTFT, TPOT) a request with `tokens` prompt tokens to compute would see on target (None: not
        known yet)."""
        queue = self._prefill_queue(target, tokens, tokens, ())
        return self._predict(target, queue, tokens)

    def _predict(
        self, target: str, queue: str | None, tokens: int, sequences: int = 1
    ) -> tuple[float | None, float | None]:
        """predict() with the queue it joins already chosen, for a request of `sequences` completions
        (each joins the decode batch; they share the prompt's pages, computed once)."""
        ttft = self._queue_s(queue, tokens)
        speed = self.speed.get(target)
        if speed is not None:
            speed.expire(self.clock() - BIAS_WINDOW_S)
        tpot = speed.step_s(len(self.in_flight[target]) + sequences) if speed else None
        return (None if ttft is None else ttft + self._bias(target, queue)), tpot

    def prefill_of(self, request_id) -> str | None:
        """The prefill worker route() chose for a new request (None: colocated, or none up)."""
        entry = self.waiting.get(request_id)
        return entry[0] if entry is not None and self.prefill_workers else None

    def _prompt_on(self, worker: str | None, target: str, tokens: int, to_compute: int, names) -> int:
        """The prompt tokens worker computes of a request routed to target (to_compute there)."""
        if worker is None or worker == target:
            return to_compute
        return max(tokens - self.overlap(worker, names) * self.page_size, 1)

    def _prefill_queue(self, target: str, tokens: int, to_compute: int, names) -> str | None:
        """Whose prompt queue a request joins: its colocated worker; disaggregated, the live prefill worker
        where it would be done soonest (the module's docstring); None when none is up."""
        if not self.prefill_workers:
            return target
        live = [p for p in self.prefill_workers if p in self.prefill_live]
        if not live:
            return None
        if self.policy == "round_robin":
            return live[self._prefill_turn % len(live)]  # route() moves the turn on when it admits
        lacks = {p: self._prompt_on(p, target, tokens, to_compute, names) for p in live}
        return min(live, key=lambda p: (self._ahead(p) + lacks[p]) / (self._rate(p) or 1.0))

    def _by_load(self, target: str, queue: str, remote_tokens: int, tokens: int, sequences: int = 1) -> str:
        """Conditional disaggregation by load: the decode worker target prefills the request itself (its
        own queue, `tokens` to compute) when the prefill worker's queue (`remote_tokens`) would break
        slo.ttft_s, target's own would be sooner, and target's decode step stays within slo.tpot_s."""
        ttft_slo, tpot_slo = self.slo
        remote = self._queue_s(queue, remote_tokens)
        if remote is None or remote + self._bias(target, queue) <= ttft_slo:
            return queue
        local = self._queue_s(target, tokens)
        speed = self.speed.get(target)
        tpot = speed.step_s(len(self.in_flight[target]) + sequences) if speed else None
        if local is None or local >= remote or (tpot is not None and tpot > tpot_slo):
            return queue
        self.local_by_load += 1
        return target

    def _rate(self, worker: str) -> float | None:
        """worker's prefill speed (tokens/s); one not measured yet is priced as its measured peers."""
        speed = self.speed.get(worker)
        if speed is not None and speed.prefill_tok_s:
            return speed.prefill_tok_s
        peers = [s.prefill_tok_s for w in (self.prefill_workers or self.workers) if (s := self.speed.get(w))]
        peers = [r for r in peers if r]
        return sum(peers) / len(peers) if peers else None

    def _ahead(self, queue: str) -> int:
        return sum(entry[1] for entry in self.waiting.values() if entry[0] == queue)

    def _queue_s(self, queue: str | None, tokens: int) -> float | None:
        """The prompt tokens ahead in queue and its own over that worker's speed (no bias)."""
        rate = self._rate(queue) if queue is not None else None
        return None if rate is None else (self._ahead(queue) + tokens) / rate

    def first_token(self, request_id) -> None:
        """request_id's first token arrived: its prompt is no longer ahead of anyone's; what it took
        beyond the prediction moves the bias."""
        entry = self.waiting.pop(request_id, None)
        if entry is not None and entry[3] is not None:
            now, queue, target = self.clock(), entry[0], entry[4]
            busy = bool(self.in_flight.get(target, set()) - {request_id}) or self._ahead(queue) > 0
            self.late.append((now, now - entry[2] - entry[3], busy))

    def _admit(
        self, target: str, queue: str | None, tokens: int, sequences: int = 1, pages: int = 0
    ) -> str | None:
        """Why admission=slo refuses a request of `sequences` completions with `tokens` prompt tokens to
        compute on target, joining queue, needing `pages` KV pages to finish (None: it does not)."""
        hold = self.cache_pages * max(self.dp, 1)
        if pages > hold:  # it could only run by being preempted and recomputed, over and over
            return (
                f"{CANNOT_FIT}: its {sequences} completion(s) need {pages} KV pages to reach max_tokens, "
                f"more than the {hold} a worker holds (lower n or max_tokens)"
            )
        ttft, tpot = self._predict(target, queue, tokens, sequences)
        ttft_slo, tpot_slo = self.slo
        if ttft is not None and ttft > ttft_slo:
            return f"rejected: predicted TTFT {ttft:.2f} s > slo.ttft_s={ttft_slo:g} (overloaded)"
        if tpot is not None and tpot > tpot_slo:
            return f"rejected: predicted TPOT {tpot:.3f} s > slo.tpot_s={tpot_slo:g} (overloaded)"
        return None

    # -- routing

    def finished_tokens(self, worker: str, request_id, token_ids, cache_salt: str | None = None) -> None:
        """finished() for a real request: its prompt and outputs (the last output has no KV yet); with
        cache events the worker says what it named itself."""
        tokens = [] if self.events else list(token_ids)[:-1]
        self.finished(worker, request_id, page_names(tokens, self.page_size, self.salt, cache_salt))

    def observe(self, worker: str, events: list[tuple[bool, bytes]]) -> None:
        """A worker's cache events, in order: (True, name) stored, (False, name) dropped."""
        cached = self.cached.get(worker)
        if cached is None:
            return
        apply_events(cached, events, self.cache_pages)
        self.events += len(events)

    def route(
        self,
        request_id,
        names: list[Hashable],
        tokens: int,
        live: list[str],
        admit: bool = False,
        sequences: int = 1,
        max_tokens: int = 0,
    ) -> str | None:
        """Pick a live worker for a request whose prompt is `tokens` long, its full pages named `names`
        (leading first), and record it there. admit: a new request (not a migrated one), which admission=slo
        may refuse (None; self.why says why), priced with all its `sequences` (n: the later completions
        follow it without admission of their own), each up to max_tokens long (0: not known)."""
        self.why = None
        if not live:
            raise ValueError("no live worker to route to")
        pages = -(-tokens // self.page_size)
        if self.policy == "round_robin":
            target = live[self._turn % len(live)]
            self._turn += 1
        elif self.policy == "least_loaded":
            target = min(live, key=lambda w: len(self.in_flight[w]))
        else:
            target = min(live, key=lambda w: (self.cost(w, names, pages), len(self.in_flight[w])))
        hit = self.overlap(target, names)
        to_compute = max(tokens - hit * self.page_size, 1)
        queue = self._prefill_queue(target, tokens, to_compute, names) if admit else None
        prompt = self._prompt_on(queue, target, tokens, to_compute, names)  # what its prefill computes
        if admit and self.by_load and queue is not None and queue != target:
            queue = self._by_load(target, queue, prompt, to_compute, sequences)
            prompt = to_compute if queue == target else prompt
        if admit and self.admission == "slo":
            # the pages to finish: the prompt's once (its completions share them), each one's outputs
            need = pages + sequences * -(-max_tokens // self.page_size)
            why, now = (
                self._admit(target, queue, prompt, sequences, need if max_tokens else 0),
                self.clock(),
            )
            last = self.admitted_at if self.admitted_at is not None else self.refusing_since
            if why is not None and why.startswith(CANNOT_FIT):  # no probe measures anything by it
                self.why = why
                self.rejected += 1
                return None
            if why is not None and last is not None and now - last >= self.probe_s:
                self.probes += 1  # refusing everything for a probe interval: measure again with this one
            elif why is not None:
                self.why = why
                self.rejected += 1
                if self.refusing_since is None:
                    self.refusing_since = now
                return None
            self.admitted_at, self.refusing_since = now, None
        if admit:  # a new request's prompt: ahead of the next ones in its queue until its first token
            self._prefill_turn += queue in self.prefill_workers  # not prefilled by its decode worker
            predicted = self._queue_s(queue, prompt)
            self.waiting[request_id] = (queue, prompt, self.clock(), predicted, target)
            if queue is not None and queue != target:
                self._remember(queue, names)  # a prefill worker: it will hold the prompt's pages
        self.routed_pages += len(names)
        self.overlap_pages += hit
        self.in_flight[target].add(request_id)
        self._pages[request_id] = pages
        self._remember(target, names)
        groups = self.groups.get(target)
        if groups is not None:
            weight = self.overlap_weight if self.policy == "cache_aware" else 0.0  # else the least loaded
            g = groups.choose(names, self._pages, weight, pages)
            groups.in_flight[g].add(request_id)
            groups.remember(g, names)
            self._group[request_id] = g
        return target

    def dp_rank_of(self, request_id) -> int | None:
        """The DP group route() chose for request_id on its worker (None: its workers have one)."""
        return self._group.get(request_id)

    def overlap(self, worker: str, names: list[Hashable]) -> int:
        """How many of names' leading pages the router believes worker caches."""
        return leading(self.cached.get(worker, {}), names)

    def cost(self, worker: str, names: list[Hashable], pages: int) -> float:
        load = sum(self._pages.get(r, 0) for r in self.in_flight[worker])
        return self.overlap_weight * self.compute_pages(worker, names, pages) + load

    def compute_pages(self, worker: str, names: list[Hashable], pages: int) -> float:
        """What the request's pages cost on worker, in pages computed: its leading device pages 0, the
        next ones below device memory their price (as the engine looks them up: device first, then
        below), the rest 1 each."""
        hit = self.overlap(worker, names)
        priced = 0.0
        for name in names[hit:]:
            price = self.below.price_of(worker, name)
            if price is None:
                break
            priced += price
            hit += 1
        return priced + (pages - hit)

    def finished(self, worker: str, request_id, names: list[Hashable] = ()) -> None:
        """request_id ended on worker; names: the pages its prompt and reply filled (now cached there)."""
        self.in_flight.get(worker, set()).discard(request_id)
        self._pages.pop(request_id, None)
        self.waiting.pop(request_id, None)
        if worker in self.cached:
            self._remember(worker, names)
        g = self._group.pop(request_id, None)
        if g is not None and worker in self.groups:
            self.groups[worker].discard(request_id)
            self.groups[worker].remember(g, names)

    def moved(self, request_id, dead: str) -> None:
        """request_id leaves dead (to be routed again)."""
        self.in_flight[dead].discard(request_id)
        self._pages.pop(request_id, None)
        self.waiting.pop(request_id, None)
        self._group.pop(request_id, None)
        if dead in self.groups:
            self.groups[dead].discard(request_id)

    def leave(self, worker: str) -> None:
        """An elastic worker starts leaving its role: it takes no new request (decode) or prompt
        (prefill); what it has in flight stays recorded until moved or finished."""
        if worker in self.workers:
            self.workers.remove(worker)
            if worker in self.cached:
                self.cached[worker].clear()  # its cache serves prompts now, not this router's requests
            if worker in self.groups:
                self.groups[worker].clear()
        if worker in self.prefill_workers:
            self.prefill_workers.remove(worker)
        self.prefill_live.discard(worker)

    def join(self, worker: str, role: str) -> None:
        """An elastic worker now serves role: decode (routed to) or prefill (chosen for prompts)."""
        if role not in ROLES:
            raise ValueError(f"role={role!r} is not allowed: one of {', '.join(ROLES)}")
        if role == Role.PREFILL and worker not in self.prefill_workers:
            self.prefill_workers.append(worker)
        elif role == Role.DECODE and worker not in self.workers:
            self.workers.append(worker)
            self.in_flight.setdefault(worker, set())
            self.cached.setdefault(worker, OrderedDict())
            if self.dp > 1:
                self.groups.setdefault(worker, Groups(self.dp, self.cache_pages))

    def measured(self, worker: str, prefill_tok_s: float | None, step_s: float | None) -> None:
        """What worker timed as it started (its Ready): where its speed starts until Loads measure it."""
        speed = self.speed.setdefault(worker, Speed())
        if prefill_tok_s and speed.prefill_tok_s is None:
            speed.prefill_tok_s = prefill_tok_s
        if step_s and not speed.decode:
            speed.decode.append((1.0, step_s, self.clock()))

    def up(self, worker: str) -> None:
        """worker is up (its Ready): a prefill worker may be chosen from now on, before its first Load."""
        if worker in self.prefill_workers:
            self.prefill_live.add(worker)

    def forget(self, worker: str) -> None:
        """worker died (or restarted): its cache is gone, its speed is measured again."""
        if worker in self.cached:
            self.cached[worker].clear()
        if worker in self.groups:
            self.groups[worker].clear()
        self.below.forget(worker)
        self.speed.pop(worker, None)
        self.prefill_live.discard(worker)

    def _remember(self, worker: str, names: Iterable[Hashable]) -> None:
        cached = self.cached.setdefault(worker, OrderedDict())
        for name in names:
            cached[name] = None
            cached.move_to_end(name)
        while len(cached) > self.cache_pages:
            cached.popitem(last=False)
