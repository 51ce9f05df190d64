"""Benchmarks sharded_jit side by side with jax.jit + NamedSharding.

Everything runs in one run, on simulated CPU devices, and is reported as
ratios ours/jax. Simulated devices share the machine's cores: the numbers
show our overhead, not scaling.

  scripts/bench [--full] [--devices 8] [--json out.json] [--only dispatch|scaling|layout|fsdp|search|search_models|pipeline|pipeline_data|plan_real|startup|multiprocess|checkpoint|tpu_models|scan_loop|published|published_v6e|calibrate]
  .venv/bin/python -m benchmarks ...   (the same, from the repo root)

By default every section runs at a smaller size (fewer cases, fewer and
smaller models, fewer rounds: ``benchmarks._scale.DEFAULT``), in about 9
minutes and 3.3 GB on 2 cores (12 minutes with another job on them), and
the rows of the cases it leaves out keep their last figures;
``--full`` is the whole run (``FULL``: about 40-44 minutes, 21 GB at its
peak). The sections below say what ``--full`` measures.

Sections (one module each):
  dispatch  per-call time (inputs already placed) and first-call time
            (trace + compile), on N devices and on 1 device.
  startup   a fresh process running one train step of a 4-layer MLP split
            over N devices: cold, then with a warm persistent cache; ours
            (SHARDED_JIT_CACHE_DIR) vs jax's own persistent cache.
            Each process is ``python -m benchmarks.startup_child``.
  multiprocess  2 ranks x N/2 devices under the launcher: first call with
            binary sharing (rank 0 compiles) vs jax.jit (every rank
            compiles), and steady-state train steps/s. Each rank is
            ``python -m benchmarks.multiprocess_child``.
  scaling   steps/s of the transformer example's train step on 1, 2, 4, 8
            devices (tensor parallel), against jax.jit running the same
            program (same in/out shardings and constraints as NamedShardings).
  layout    each system at its best on the same model: the transformer on
            2 x 4 (data x model, Megatron), ours partitioner.pmap x
            sharded_jit against jax.jit on a ('data', 'model') mesh:
            collectives, bytes, parameter bytes per device, steps/s.
  fsdp      FSDP over 8 and FSDP x TP 2 x 4 of the transformer at two sizes
            (the example's, and d_model 1024), ours (fsdp_specs,
            fsdp_tp_specs) against jax.jit with MaxText's specs on a
            ('fsdp', 'tensor') mesh: collectives, bytes, peak memory and
            parameter bytes per device, steps/s.
  search    the layout partitioner.search finds against every hand-written
            layout, on two transformers, two MLPs and a recommender; also planned for 2
            hosts x 4 against the hand-written layouts' bytes across hosts; and a
            repeated search in a fresh process (``benchmarks.search_repeat``).
  search_models  the search on a third-party decoder (transformers'
            FlaxGemmaForCausalLM, bf16, one key/value head) at 2 and 24
            layers, each depth a ``python -m benchmarks.search_models LAYERS ...``
            child: search time, candidates estimated and compiled, the
            found layout's steps/s against the fastest hand-written one;
            then a plan for 8 hosts x 8 H100s from 64 simulated devices
            (``python -m benchmarks.search_cluster``) (needs the
            thirdparty extra; the 24-layer child, --full only, holds about
            21 GB).
  pipeline  partitioner.pipeline in a sharded_jit train step against the
            GPipe a jax user writes by hand following MaxText (jax.jit,
            a ('stage',) mesh, roll-shifted state buffer) on a 16-layer
            residual MLP, 2, 4 and 8 stages: steps/s, collective bytes,
            matmul flops against the ideal with the bubble, weights per
            device;
            and bytes across 2 hosts x 4 against data parallel 8.
  pipeline_data  pipeline stages with data parallelism inside them (2 x 4
            and 4 x 2 stages x data) against MaxText's GPipe on a
            ('stage', 'data') mesh in jax.jit: steps/s, collective bytes,
            the weight gradients' reduction over data; with --full, a GPT
            stack at cluster scale on 64 simulated devices, compiled only
            (``python -m benchmarks.pipeline_data``): collective bytes per
            device per step against one gradient reduction plus the
            permutes, S x D from 2 x 32 to 32 x 2.
  plan_real  plans of real size from shapes only: Llama 3 8B's train step
            for 8 x H100 (``python -m benchmarks.plan_real 8b``): search
            time, the winner's peak per device against the budget and
            against docs/search.md's first-principles account; with --full,
            Llama 3 70B's for 8 hosts x 8 H100s (``... 70b``).
  scan_loop  the same MLP stack (width 2048, hidden 8192, bfloat16, FSDP
            8) as a lax.scan over stacked weights and as a Python loop,
            at 4, 16 and 32 layers, with and without remat, compiled (not
            run) by XLA:CPU, and by XLA:TPU and XLA:GPU where libtpu and
            jax's CUDA plugin are installed: the scan's estimated step over
            the loop's (``partitioner.cost``).

  published  the named device models' estimates against published
            TFLOP/s per chip: by default the GPU tables, compiled for
            simulated devices (MaxText's A3: Llama 2 7B on 1 to 16 hosts
            of 8 H100s; MosaicML's MPT 1B to 30B on 8 A100s, 7 rates, and
            on 8 H100s at 512 to 65536 tokens a sequence, 30 rates), and
            with jax's CUDA plugin (the cuda extra: ``WITH_CUDA=1``) the
            same three compiled by XLA:GPU too (about 6.5 minutes more);
            with --full and libtpu also MaxText's v5e, v5p and v4 tables
            (46 rates, each compiled by XLA:TPU).
  published_v6e  only by name (``--full --only published_v6e``, libtpu
            installed: 47-76 minutes, its 10 compiles taking 4-7 minutes
            each), the ``tpu-v6e`` model against Google's Trillium recipes
            (tpu-recipes: MaxText's Llama 3.1 8B on 8 to 256 chips, 70B on
            32 to 256, one slice each, 8192 tokens a sequence): five of
            their ten measured rates, each compiled by XLA:TPU.
  calibrate  how well ``partitioner.calibrate()``'s model (on a CPU, its
            rates fitted to its own small family of train steps) predicts
            the measured times of the search section's 34 programs, which
            it never saw: the rms relative error, beside the default cpu
            model's, and the layout its estimate picks per model
            (``python -m benchmarks.calibrate`` prints it, with the fit).

Unless --no-write, results go to benchmarks/results.json (each summary
figure's last runs kept), the summary and the tables into BENCHMARKS.md
(between its "generated" markers) and, when matplotlib is installed, plots
to benchmarks/*.png (see ``benchmarks.report``; ``python -m
benchmarks.report`` rewrites BENCHMARKS.md from results.json alone).

This package is run from the repo root and is not installed. Importing it
imports nothing else: the startup children time their own process start.
"""
import os

# Every search is timed from scratch: no answer from an earlier run's
# directory of answers (partitioner.config.search_cache_dir); the children
# inherit it.
os.environ.setdefault("SHARDED_JIT_SEARCH_CACHE_DIR", "off")
