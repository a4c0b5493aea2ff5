"""The deployment runtime: its config (config.py), the fleet of worker processes (fleet.py), the main
job's driver (driver.py), the Router and Planner (policy.py), the worker processes (worker.py), the typed
messages between them (messages.py) and the HTTP front (server.py). The experiment tools around it
(experiments.run, metrics, plots, workload, load, the simulator, the benchmarks) use it; the simulator
imports only its message and record types and the router's policy (policy.py), never process code."""
