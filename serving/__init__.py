"""The deployment runtime: a deployment's worker processes and the one request loop over them.

The life of a request (each step names where it happens):

 1. It arrives. Over HTTP: `routes.generate` (guard, body_of) -> `api.App.prepare` (chat template and
    grammar in the sandboxes, `sandbox.py`) -> `api.App.parse` (every field checked, `fields.py`: one
    engine `SamplingParams` inside a `messages.Submit`) -> `api.App.start` -> `Runtime.submit`. From the
    main job: `experiments.driver._generate` submits each arrival of the workload the same way.
 2. The runtime routes it (`runtime.Runtime._route`, on its own thread): `policy.Router.route_tokens`
    picks the decode (or colocated) worker by cache overlap and load, and the prefill worker; admission
    (deployment.admission=slo) may refuse it at once (`ErrorKind.REJECTED`). `fleet.Fleet.send` sends
    the Submit over the authenticated control socket (`control.py`).
 3. The decode worker takes it (`worker.Worker._handle`): a colocated worker, or a short prompt, goes
    straight to its engine (`engine.LLM.add_request`); otherwise `decode_front.DecodeFront.take` queues
    it and `DecodeFront.drain` asks a prefill worker: `transfer.decode.DecodeMessenger.submit` reserves
    its pages and sends a PrefillRequest naming those the decode worker's prefix cache lacks.
 4. The prefill worker computes the prompt (`transfer.prefill.PrefillMessenger.poll` -> its engine's
    `EngineCore.step`, chunk by chunk) and writes each page into the decode worker's memory layer by
    layer while later layers still compute (`PrefillMessenger.on_batch`; NIXL writes), then the last
    position's hidden state (`on_prefilled`), and says Ended.
 5. The decode worker admits it once every write has landed (`DecodeMessenger.poll` ->
    `llm.handoff.admit_prefilled`) and decodes it with the others (`Worker._step` -> `EngineCore.step`:
    schedule, run, sample, post-process).
 6. Each step's new tokens stream back (`Worker._progress`: Progress) to the runtime
    (`Runtime._message`), which times them and passes them to the request's sink: the client's
    server-sent events (`routes.stream`) or the main job's record. The end comes as a Result
    (`Worker._report` -> `Runtime._finish`), its pages free on both sides.
 7. If a worker dies, goes silent or leaves the decode role, the runtime resubmits its requests
    elsewhere after the tokens they had (`Runtime._migrate`), or prefills one again when only its prefill
    worker died (`Runtime._prefill_again`); a failure that ends a request carries its ErrorKind, which
    `errors.STATUS` maps to an HTTP status.

Where each part lives (dependencies point down: experiments -> serving -> engine -> transfer):
- here: config.py and checks.py (the deployment's config, checked once), runtime.py (the request loop),
  messages.py and control.py (the runtime's wire messages and its authenticated socket), worker.py,
  decode_front.py and roles.py (a worker process), elastic.py (moving workers
  between roles);
- router/: policy.py (the Router and admission), belief.py and below.py (what it believes each worker
  caches and how fast it runs), planner.py (when to move a worker between roles);
- fleet/: fleet.py (start, watch, restart and stop the workers), launcher.py (local
  processes or Ray actors), procs.py (their children), preload.py (the fork server's imports), netns*.py
  (hosts in network namespaces, their links and faults);
- http/: the OpenAI-compatible front: server.py (serve), server_config.py, routes.py, api.py, fields.py,
  errors.py, shapes.py, sandbox.py, connections.py, metrics.py.
The experiment tools (experiments.run and its driver, metrics, workload, the load client, the
simulator) use it; nothing here imports them (`make lint` checks).
"""
