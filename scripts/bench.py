"""Benchmarks sharded_jit side by side with jax.jit + NamedSharding.

Everything runs in one run, on simulated CPU devices, and is reported as
ratios ours/jax. Simulated devices share the machine's cores: the numbers
show our overhead, not scaling.

  .venv/bin/python scripts/bench.py [--devices 8] [--json out.json] [--only dispatch|startup|multiprocess]

Sections:
  dispatch  per-call time (inputs already placed) and first-call time
            (trace + compile), on N devices and on 1 device.
  startup   a fresh process running one train step of a 4-layer MLP split
            over N devices: cold, then with a warm persistent cache; ours
            (SHARDED_JIT_CACHE_DIR) vs jax's own persistent cache.
  multiprocess  2 ranks x N/2 devices under the launcher: first call with
            binary sharing (rank 0 compiles) vs jax.jit (every rank
            compiles), and steady-state train steps/s.
  scaling   steps/s of the transformer example's train step on 1, 2, 4, 8
            devices (data x model), against jax.jit running the same
            program (same in/out shardings and constraints as NamedShardings).

Unless --no-write, results go to benchmarks/results.json, the tables into
BENCHMARKS.md (between its "generated" markers) and, when matplotlib is
installed, plots to benchmarks/*.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

_BATCH = 50
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ARGS = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_ARGS.add_argument("--devices", type=int, default=8)
_ARGS.add_argument("--calls", type=int, default=10000, help="timed calls per dispatch case")
_ARGS.add_argument("--first-calls", type=int, default=7,
                   help="fresh functions traced and compiled per case")
_ARGS.add_argument("--startup-runs", type=int, default=3,
                   help="cold and warm processes per startup case (medians)")
_ARGS.add_argument("--only", choices=["dispatch", "startup", "multiprocess", "scaling"])
_ARGS.add_argument("--no-write", action="store_true", help="only print the tables")
_ARGS.add_argument("--steps", type=int, default=30, help="timed train steps (multiprocess)")
_ARGS.add_argument("--json", help="also write the results here")
_ARGS.add_argument("--child", choices=["ours", "jax", "mp"], help=argparse.SUPPRESS)
_ARGS.add_argument("--cache-dir", help=argparse.SUPPRESS)
_ARGS.add_argument("--which", choices=["ours", "jax"], help=argparse.SUPPRESS)
_ARGS.add_argument("--started", type=float, help=argparse.SUPPRESS)


def _setup_jax(devices: int):
  sys.path.insert(0, _ROOT)
  from partitioner.launch import with_cpu_device_count
  os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), devices)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  return jax


def dispatch(args) -> list[dict]:
  jax = _setup_jax(args.devices)
  import jax.numpy as jnp
  import numpy as np

  from partitioner import clear_caches, sharded_jit
  from sharding import PartitionSpec as P

  def make_fn():
    # A fresh function object each time, so nothing is cached across builds.
    def layer(x, w):
      return jnp.tanh(x @ w) * 0.5 + x
    return layer

  def build(n: int):
    """(ours, theirs, ours' inputs, theirs' inputs) for n devices."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 32)).astype(np.float32)
    w = rng.normal(size=(32, 32)).astype(np.float32)
    spec = P(n, 1) if n > 1 else None
    ours = sharded_jit(make_fn(), in_parts=(spec, None), out_parts=spec,
                       num_partitions=n)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))
    row = jax.sharding.NamedSharding(mesh, jax.P("x" if n > 1 else None, None))
    rep = jax.sharding.NamedSharding(mesh, jax.P())
    theirs = jax.jit(make_fn(), in_shardings=(row, rep), out_shardings=row)
    placed = ours.lower(x, w).in_shardings
    ours_in = (jax.device_put(x, placed[0]), jax.device_put(w, placed[1]))
    theirs_in = (jax.device_put(x, row), jax.device_put(w, rep))
    return ours, theirs, ours_in, theirs_in

  def warm_up(fn, inputs) -> None:
    for _ in range(50):  # the first executions of a program are slower
      fn(*inputs).block_until_ready()

  def batch(fn, inputs, calls: int) -> float:
    """Seconds per call over ``calls`` back-to-back calls (one wait at the end)."""
    t0 = time.perf_counter()
    for _ in range(calls):
      out = fn(*inputs)
    out.block_until_ready()
    return (time.perf_counter() - t0) / calls

  def first_call(fn, inputs) -> float:
    t0 = time.perf_counter()
    fn(*inputs).block_until_ready()
    return time.perf_counter() - t0

  cases = []
  for n in sorted({args.devices, 1}, reverse=True):
    ours, theirs, ours_in, theirs_in = build(n)
    np.testing.assert_allclose(ours(*ours_in), theirs(*theirs_in), rtol=1e-5)
    warm_up(ours, ours_in)
    warm_up(theirs, theirs_in)
    # Alternate small batches of the two so that machine noise hits both
    # alike; report the median batch.
    a, b = [], []
    for _ in range(max(1, args.calls // _BATCH)):
      a.append(batch(ours, ours_in, _BATCH))
      b.append(batch(theirs, theirs_in, _BATCH))
    cases.append({"case": f"per-call, {n} device(s)", "unit": "us",
                  "ours": statistics.median(a) * 1e6, "jax": statistics.median(b) * 1e6})
    fa, fb = [], []
    for _ in range(args.first_calls):  # fresh functions: trace + compile each time
      ours, theirs, ours_in, theirs_in = build(n)
      clear_caches()  # or the program is found among this process's executables
      fa.append(first_call(ours, ours_in))
      fb.append(first_call(theirs, theirs_in))
    cases.append({"case": f"first call, {n} device(s)", "unit": "ms",
                  "ours": statistics.median(fa) * 1e3, "jax": statistics.median(fb) * 1e3})
  return cases


def startup_child(args) -> None:
  """One fresh process: build the MLP, run one train step, report times."""
  jax = _setup_jax(args.devices)
  compile_part = []  # jax: seconds in backend compile or cache retrieval
  if args.child == "jax":
    def listen(event, duration, **kwargs):
      if event in ("/jax/core/compile/backend_compile_duration",
                   "/jax/compilation_cache/cache_retrieval_time_sec"):
        compile_part.append(duration)
    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.config.update("jax_compilation_cache_dir", args.cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  from partitioner import compilation_stats, config

  n = args.devices
  if args.child == "ours":
    config.cache_dir = args.cache_dir
  fn, params, x = _mlp_step(jax, args.child == "ours", n)
  t0 = time.perf_counter()
  _, loss = fn(params, x)
  loss.block_until_ready()
  first = time.perf_counter() - t0
  if args.child == "ours":
    stats = compilation_stats()
    compile_part.append(stats["compile_secs"] + stats["persistent_load_secs"])
  print(json.dumps({"first_call": first, "to_first_result": time.time() - args.started,
                    "compile_part": sum(compile_part), "loss": float(loss)}))


def _mlp_step(jax, ours: bool, n: int, width: int = 512, layers: int = 4):
  """(train step, params, batch): a tensor-parallel MLP over n devices.

  Ours is a sharded_jit; theirs the same step under jax.jit with the same
  layout as NamedShardings over a 1-D mesh of the same devices.
  """
  import jax.numpy as jnp
  import numpy as np

  from partitioner import sharded_jit
  from sharding import PartitionSpec as P
  from sharding import with_sharding_constraint as wsc

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("x",))

  def constrain(h):  # the same constraint on both sides: the same program
    if ours:
      return wsc(h, P(1, n))
    return jax.lax.with_sharding_constraint(
        h, jax.sharding.NamedSharding(mesh, jax.P(None, "x")))

  def loss_fn(params, x):
    h = x
    for i in range(layers):
      h = constrain(jax.nn.relu(h @ params[f"up{i}"]))
      h = h @ params[f"down{i}"]
    return jnp.mean(h ** 2)

  def step(params, x):
    loss, grads = jax.value_and_grad(loss_fn)(params, x)
    return jax.tree_util.tree_map(lambda p, g: p - 0.01 * g, params, grads), loss

  rng = np.random.default_rng(0)
  params = {}
  for i in range(layers):
    params[f"up{i}"] = rng.normal(0, 0.05, (width, 2 * width)).astype(np.float32)
    params[f"down{i}"] = rng.normal(0, 0.05, (2 * width, width)).astype(np.float32)
  x = rng.normal(size=(64, width)).astype(np.float32)
  if ours:
    parts = {k: (P(1, n) if k.startswith("up") else P(n, 1)) for k in params}
    return sharded_jit(step, in_parts=(parts, None), out_parts=(parts, None)), params, x
  col = jax.sharding.NamedSharding(mesh, jax.P(None, "x"))
  row = jax.sharding.NamedSharding(mesh, jax.P("x", None))
  rep = jax.sharding.NamedSharding(mesh, jax.P())
  parts = {k: (col if k.startswith("up") else row) for k in params}
  fn = jax.jit(step, in_shardings=(parts, rep), out_shardings=(parts, rep))
  fn.in_shardings_flat = jax.tree_util.tree_leaves((parts, rep))  # for the benchmark
  return fn, params, x


def multiprocess_child(args) -> None:
  """One rank of the 2-rank benchmark (run under partitioner.launch)."""
  import partitioner
  world = partitioner.initialize()
  jax = _setup_jax(args.devices)  # the launcher set the per-process device count
  n = len(jax.devices())
  ours = args.which == "ours"
  fn, params, x = _mlp_step(jax, ours, n)
  # Global inputs, placed the same way for both (outside the timings).
  shardings = fn.lower(params, x).in_shardings if ours else fn.in_shardings_flat
  leaves, tree = jax.tree_util.tree_flatten((params, x))
  placed = [jax.make_array_from_callback(v.shape, s, lambda i, v=v: v[i])
            for v, s in zip(leaves, shardings)]
  params, x = jax.tree_util.tree_unflatten(tree, placed)
  world.rendezvous("the benchmark")
  t0 = time.perf_counter()
  params, loss = fn(params, x)
  loss.block_until_ready()
  first = time.perf_counter() - t0
  for _ in range(3):
    params, loss = fn(params, x)
  loss.block_until_ready()
  world.rendezvous("the benchmark")
  t0 = time.perf_counter()
  for _ in range(args.steps):
    params, loss = fn(params, x)
  loss.block_until_ready()
  result = {"first_call": first, "steps_per_sec": args.steps / (time.perf_counter() - t0),
            "loss": float(loss), "compiles": partitioner.compilation_stats()["compiles"]}
  gathered = world.comm.gather(result, root=0)
  if world.rank == 0:
    print("RESULT " + json.dumps(gathered))


def multiprocess(args) -> list[dict]:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("SHARDED_JIT_", "XLA_FLAGS"))}
  ranks = {}
  for which in ("ours", "jax"):  # separate jobs: neither warms the other's caches
    cmd = [sys.executable, "-m", "partitioner.launch", "-n", "2",
           "--devices-per-process", str(args.devices // 2), "--timeout", "600",
           os.path.abspath(__file__), "--child", "mp", "--which", which,
           "--devices", str(args.devices // 2), "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, cwd=_ROOT, capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
      raise RuntimeError(f"the 2-rank benchmark failed:\n{out.stdout}\n{out.stderr}")
    ranks[which] = json.loads(lines[-1][len("RESULT "):])
  for a, b in zip(ranks["ours"], ranks["jax"]):
    assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1, abs(b["loss"])), (a, b)
  cases = []
  for field, label, unit, scale, pick in (
      ("first_call", "first call, slowest rank (trace + compile + run)", "ms", 1e3, max),
      ("steps_per_sec", "train steps/s, slowest rank", "steps/s", 1, min)):
    ours = pick(r[field] for r in ranks["ours"]) * scale
    theirs = pick(r[field] for r in ranks["jax"]) * scale
    cases.append({"case": f"2 ranks x {args.devices // 2} devices: {label}",
                  "unit": unit, "ours": ours, "jax": theirs, "ratio": ours / theirs})
  cases.append({"case": "XLA compilations per rank (ours)", "unit": "",
                "ours": [r["compiles"] for r in ranks["ours"]], "jax": None, "ratio": None})
  return cases


def scaling(args) -> list[dict]:
  """The transformer train step on 1, 2, 4, 8 devices: ours vs jax.jit."""
  jax = _setup_jax(args.devices)
  import importlib.util

  import numpy as np

  from partitioner import sharded_jit
  from sharding import tiling
  from sharding._spec_tree import broadcast_specs

  spec = importlib.util.spec_from_file_location(
      "transformer_example", os.path.join(_ROOT, "examples", "transformer.py"))
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  layouts = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}
  cases = []
  for n in [k for k in layouts if k <= args.devices]:
    dp, mp = layouts[n]
    devices = jax.devices()[:n]

    def named(spec, ndim):
      return tiling(spec, devices, ndim).named_sharding()

    def jax_constraint(x, spec):
      return jax.lax.with_sharding_constraint(x, named(spec, x.ndim))

    size = dict(width=128, heads=8, layers=2, seq=64, vocab=104, lr=1e-3)
    ours_model = example.Model(dp, mp, **size)
    theirs_model = example.Model(dp, mp, constrain=jax_constraint, **size)
    params, opt = ours_model.init(jax.random.PRNGKey(0))
    seqs = np.random.default_rng(0).integers(0, 100, (16, 65)).astype(np.int32)
    args_tree = (params, opt, seqs)
    parts = (ours_model.param_parts, ours_model.opt_parts, ours_model.batch_parts)
    leaves, tree = jax.tree_util.tree_flatten(args_tree)
    specs = broadcast_specs(parts, args_tree, "parts")
    in_shardings = jax.tree_util.tree_unflatten(
        tree, [named(s, np.ndim(x)) for s, x in zip(specs, leaves)])
    out_parts = (ours_model.param_parts, ours_model.opt_parts, None)
    ours = sharded_jit(ours_model.step, in_parts=parts, out_parts=out_parts, num_partitions=n)
    theirs = jax.jit(theirs_model.step, in_shardings=in_shardings,
                     out_shardings=(in_shardings[0], in_shardings[1], named(None, 0)))
    placed = jax.device_put(args_tree, in_shardings)
    state = {"ours": placed, "jax": placed}
    fns = {"ours": ours, "jax": theirs}

    def run(which, steps):
      p, o, _ = state[which]
      for _ in range(steps):
        p, o, loss = fns[which](p, o, seqs)
      loss.block_until_ready()
      state[which] = (p, o, seqs)
      return float(loss)

    losses = {w: run(w, 3) for w in fns}  # warm up (and compile)
    assert abs(losses["ours"] - losses["jax"]) < 1e-3 * abs(losses["jax"]), losses
    rates = {"ours": [], "jax": []}
    per_round = 3
    for _ in range(max(2, 2 * args.steps // per_round)):  # alternate: noise hits both alike
      for which in fns:
        t0 = time.perf_counter()
        run(which, per_round)
        rates[which].append(per_round / (time.perf_counter() - t0))
    ours_rate, jax_rate = statistics.median(rates["ours"]), statistics.median(rates["jax"])
    cases.append({"case": f"transformer train step, {n} device(s) ({dp} x {mp})",
                  "devices": n, "unit": "steps/s", "ours": ours_rate, "jax": jax_rate,
                  "ratio": ours_rate / jax_rate})
  return cases


def startup(args) -> list[dict]:
  def run(which: str, cache_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDED_JIT_")}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", which,
           "--cache-dir", cache_dir, "--devices", str(args.devices),
           "--started", str(time.time())]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])

  cases, results = [], {"ours": ([], []), "jax": ([], [])}
  for _ in range(args.startup_runs):  # alternate ours and jax, cold then warm
    for which in ("ours", "jax"):
      with tempfile.TemporaryDirectory() as d:
        results[which][0].append(run(which, d))
        results[which][1].append(run(which, d))
  for which, (cold, warm) in results.items():
    assert all(abs(w["loss"] - cold[0]["loss"]) < 1e-6 for w in cold + warm), (cold, warm)
  for field, label in (("compile_part", "compile or load from cache"),
                       ("first_call", "first call (trace + compile or load + run)"),
                       ("to_first_result", "process start to first result")):
    for which in ("ours", "jax"):
      cold, warm = results[which]
      cold_t = statistics.median(c[field] for c in cold)
      warm_t = statistics.median(w[field] for w in warm)
      cases.append({"case": f"{label}, {which}", "unit": "ms",
                    "cold": cold_t * 1e3, "warm": warm_t * 1e3,
                    "cold/warm": cold_t / warm_t})
  return cases


def tables(results: dict) -> str:
  """All sections as markdown tables."""
  out = [f"jax {results.get('jax', '?')}, {results['platform']}, {results['devices']}"
         f" simulated devices, {results['cores']} cores"]
  ratio_header = ["| case | sharded_jit | jax.jit + NamedSharding | ratio ours/jax |",
                  "|---|---|---|---|"]
  if "dispatch" in results:
    out += ["", "Dispatch and first call (ratio: lower is better):", "", *ratio_header]
    out += [f"| {c['case']} | {c['ours']:.1f} {c['unit']} | {c['jax']:.1f} {c['unit']}"
            f" | {c['ratio']:.2f} |" for c in results["dispatch"]]
  if "scaling" in results:
    out += ["", "Transformer train step, steps/s (ratio: higher is better):", "",
            *ratio_header]
    out += [f"| {c['case']} | {c['ours']:.1f} {c['unit']} | {c['jax']:.1f} {c['unit']}"
            f" | {c['ratio']:.2f} |" for c in results["scaling"]]
  if "startup" in results:
    out += ["", "| startup, 4-layer MLP train step | cold | warm cache | cold/warm |",
            "|---|---|---|---|"]
    out += [f"| {c['case']} | {c['cold']:.1f} ms | {c['warm']:.1f} ms | {c['cold/warm']:.1f}x |"
            for c in results["startup"]]
  if "multiprocess" in results:
    out += ["", "2 ranks under the launcher (first call: lower is better; steps/s:"
            " higher is better):", "", *ratio_header]
    for c in results["multiprocess"]:
      if c["ratio"] is None:
        out.append(f"| {c['case']} | {c['ours']} | every rank compiles | |")
      else:
        out.append(f"| {c['case']} | {c['ours']:.1f} {c['unit']} | {c['jax']:.1f}"
                   f" {c['unit']} | {c['ratio']:.2f} |")
  return "\n".join(out)


def plots(results: dict, directory: str) -> list[str]:
  """PNG plots when matplotlib is installed; returns the files written."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("(matplotlib is not installed: no plots)")
    return []
  written = []
  if "scaling" in results:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    devices = [c["devices"] for c in results["scaling"]]
    for which, label in (("ours", "sharded_jit"), ("jax", "jax.jit + NamedSharding")):
      ax.plot(devices, [c[which] for c in results["scaling"]], marker="o", label=label)
    ax.set_xlabel("simulated CPU devices")
    ax.set_ylabel("train steps / s")
    ax.set_xticks(devices)
    ax.set_title("transformer train step")
    ax.legend()
    fig.tight_layout()
    written.append(os.path.join(directory, "steps_per_sec.png"))
    fig.savefig(written[-1], dpi=110)
  if "startup" in results:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rows = [c for c in results["startup"] if c["case"].startswith("compile or load")]
    labels = [c["case"].rsplit(", ", 1)[1] for c in rows]
    x = range(len(rows))
    ax.bar([i - 0.2 for i in x], [c["cold"] for c in rows], 0.4, label="cold")
    ax.bar([i + 0.2 for i in x], [c["warm"] for c in rows], 0.4, label="warm cache")
    ax.set_xticks(list(x), ["sharded_jit" if l == "ours" else "jax" for l in labels])
    ax.set_ylabel("ms to compile or load")
    ax.set_title("first call in a fresh process: compile part")
    ax.legend()
    fig.tight_layout()
    written.append(os.path.join(directory, "first_call_cold_warm.png"))
    fig.savefig(written[-1], dpi=110)
  return written


_BEGIN, _END = "<!-- generated by scripts/bench.py: begin -->", "<!-- generated by scripts/bench.py: end -->"


def write(results: dict, command: str) -> None:
  """Updates benchmarks/results.json (sections not run keep their last
  figures and command), BENCHMARKS.md's generated block and the plots."""
  directory = os.path.join(_ROOT, "benchmarks")
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, "results.json")
  merged = {}
  if os.path.exists(path):
    with open(path) as f:
      merged = json.load(f)
  commands = merged.get("commands", {})
  for name in ("dispatch", "scaling", "startup", "multiprocess"):
    if name in results:
      commands[name] = f"{command} ({results['date']})"
  merged.update(results)
  merged["commands"] = commands
  results = merged
  with open(path, "w") as f:
    json.dump(results, f, indent=2)
  images = plots(results, directory)
  by_command: dict[str, list[str]] = {}
  for section, cmd in results["commands"].items():
    by_command.setdefault(cmd, []).append(section)
  block = [_BEGIN, ""]
  for cmd, sections in by_command.items():
    run, _, date = cmd.rpartition(" (")
    block.append(f"- {', '.join(sections)}: `{run}` on {date.rstrip(')')}")
  block += ["", tables(results)]
  block += ["", *[f"![{os.path.basename(p)}](benchmarks/{os.path.basename(p)})"
                  for p in images], _END]
  path = os.path.join(_ROOT, "BENCHMARKS.md")
  with open(path) as f:
    text = f.read()
  if _BEGIN in text and _END in text:
    text = text[:text.index(_BEGIN)] + "\n".join(block) + text[text.index(_END) + len(_END):]
  else:
    text = text.rstrip() + "\n\n## Latest run\n\n" + "\n".join(block) + "\n"
  with open(path, "w") as f:
    f.write(text)
  print(f"wrote benchmarks/results.json, BENCHMARKS.md{''.join(', ' + os.path.relpath(p, _ROOT) for p in images)}")


def main() -> None:
  args = _ARGS.parse_args()
  if args.child == "mp":
    return multiprocess_child(args)
  if args.child:
    return startup_child(args)
  results = {"devices": args.devices, "cores": os.cpu_count(),
             "date": time.strftime("%Y-%m-%d")}
  sections = {"dispatch": dispatch, "scaling": scaling, "startup": startup,
              "multiprocess": multiprocess}
  for name, run in sections.items():
    if args.only in (None, name):
      results[name] = run(args)
  import jax
  results["jax"] = jax.__version__
  results["platform"] = jax.devices()[0].platform
  for c in results.get("dispatch", []):
    c["ratio"] = c["ours"] / c["jax"]
  print(tables(results))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=2)
  if not args.no_write:
    write(results, "python scripts/bench.py" + "".join(" " + a for a in sys.argv[1:]))


if __name__ == "__main__":
  main()
