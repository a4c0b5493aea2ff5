"""Experiments: the hydra main job (run.py, later), the kernel benchmark suite (bench/), reproductions."""
