"""Front ends: sharded_jit, partitioner.pmap, calls on tracers, explain() and cost()."""
