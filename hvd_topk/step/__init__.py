"""The step: what one synchronized step of either front door runs (the coordinator and its units, Horovod's
optimizer overrides, TopKEF's gradient keys and token, checkpoints, elastic)."""
