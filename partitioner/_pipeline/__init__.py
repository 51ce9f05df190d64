"""partitioner.pipeline: pipeline parallelism inside the one SPMD program."""
