"""Ranks agreeing, never silent and never a hang: the same collectives at compile time, the same
step before the optimizer's collectives, the same initial weights, a heartbeat that tells a busy rank
from a diverged one, and a watch that ends a deadlock in the user's own collectives."""
