"""The sharded-parameter runtime: each parameter's flat 1/N shard, its refusing stage-3 form, module
buffers kept equal across ranks, state-dict hooks and the model-state bytes each rank holds."""
