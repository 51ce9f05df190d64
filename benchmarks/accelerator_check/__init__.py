"""Checks a machine for sharded_jit: ``scripts/accelerator-check``.

  scripts/accelerator-check [--report PATH] [--no-install] [--python PATH]
  python -m benchmarks.accelerator_check [--report PATH] [--no-install]   (from the repo root)

It finds the accelerators jax sees (GPU or TPU: platform, kind, count,
memory). Where a GPU (``nvidia-smi`` answers) or a TPU (``/dev/accel*``,
``/dev/vfio/N``) is present but the installed jax cannot use it, it
installs jax's plugin for it (``jax[cuda12]``, or ``jax[tpu]``, at the
installed jax's version) when a package registry is reachable, and
otherwise goes on with the jax it has (``--no-install``: never installs).
Then it runs the checks, each recorded pass, fail or skip with its time:

- data parallel, FSDP, tensor parallel (a Megatron MLP) and pipeline
  (``partitioner.pipeline``): three SGD steps of a ``sharded_jit`` train
  step on every device found, against ``jax.jit`` with ``NamedSharding``s
  of the same layout, at matmul precision "highest": the losses and
  weights agree within check mode's float32 tolerance for the platform
  (``partitioner.check_tolerance``),
  and the weights come back in the same layout;
- donation: the donated weights are deleted by the call (the first call
  and a call-cache hit), the batch is not;
- calibration: ``partitioner.calibrate()`` on the devices found (matmul
  rate, memory bandwidth, collectives by size), written beside the report
  (``accelerator-check-calibration.json``, a ``search(device_model=)``
  file), each figure next to the named device model's;
- the persistent compilation cache: a process compiles and writes the
  program to a fresh ``SHARDED_JIT_CACHE_DIR``; a second, fresh process
  loads it (a persistent hit, no compile) and computes the same loss;
- two processes on this host under ``python -m partitioner.launch``
  (``benchmarks.multiprocess_child``; K GPUs each on a host with 2 GPUs
  or more, else 4 simulated CPU devices each): rank 0 compiles, rank 1
  loads its binary, and the loss matches one process's;
- steps/s of sharded_jit against jax.jit + NamedSharding on a data parallel
  and a tensor parallel MLP (weights donated and kept on the devices,
  interleaved rounds, medians): reported as ratios; such a check fails
  only if the two sides' losses differ, never on speed;
- on an accelerator, a plan against the device (``benchmarks.plan_check``:
  a 0.3B-parameter decoder's memory as the search counts it against XLA's,
  and the device models' step time against the measured one), the test
  suite (``SHARDED_JIT_TEST_PLATFORM`` set,
  so tests/conftest.py keeps to the accelerator; tests that need the 8
  simulated CPU devices skip, ``slow`` and ``mpi`` tests are left out) and
  the ``dispatch`` and ``scaling`` benchmark sections on its devices.

Without an accelerator it says so and runs the same checks on 8 simulated
CPU devices. It writes a markdown report (default ``accelerator-check.md``
in the current directory) and exits 1 if any check failed.

Every check that uses a device runs in a child process, one at a time
(``python -c`` calling a function of ``children.py``: ``device_checks``,
``cache_child``, ``reference_child``, ``calibrate_child``): a crash costs
that child's checks, not the run, and a TPU, which one process holds at a
time, is free for the next child.

The package, by concern: ``records`` (what each check found, how far
results differ), ``layouts`` (the train steps checked and timed),
``children`` (what each child process runs), ``machine`` (finding the
accelerators and jax's plugin), ``checks`` (each check, in a child),
``command`` (the report and ``main``).
"""
