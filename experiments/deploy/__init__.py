"""The deployment runtime: the driver and router (driver.py), the worker processes (worker.py), the typed
messages between them (messages.py) and the HTTP front (server.py). The experiment tools around it
(experiments.run, metrics, plots, workload, load, the simulator, the benchmarks) use it; the simulator
imports only its message and record types and the router's policy (policy.py), never process code."""
