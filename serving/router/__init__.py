"""Which worker takes a request (policy.Router, its admission), what the router believes of each worker
(belief, below), and when a worker moves between roles (planner): for the runtime and the simulator."""
