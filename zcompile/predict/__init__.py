"""Prediction before running: memory estimates, simulated worlds, hardware profiles, the cost model
and a step's peak read from its compiled graphs."""
