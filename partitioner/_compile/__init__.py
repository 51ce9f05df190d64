"""Compile and run: the partition step, stage objects, compile, load, execute, the cache."""
