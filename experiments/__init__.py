"""Experiments: the hydra main job (run.py), the simulator (sim/), the kernel benchmark suite (bench/),
reproductions (repro/).

Importing the package registers the config's dataclasses with hydra's ConfigStore (experiments/schema.py),
so that any compose of conf/ finds their defaults.
"""

import experiments.schema  # noqa: F401
