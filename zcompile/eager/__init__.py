"""Eager helpers over sharded models: the full parameters and gradients (``zcompile.gathered``) and
weight averaging on what each rank holds (``zcompile.lerp_weights_``)."""
