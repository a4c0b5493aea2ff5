"""The serving simulator: a roofline cost model (cost.py) over hardware and model presets."""
