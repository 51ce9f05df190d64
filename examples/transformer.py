"""A small decoder-only transformer language model, trained data x model parallel.

The model learns to write Python documentation one character at a time: the
corpus is the help text that ships with CPython (``pydoc_data.topics``,
~460k characters), so nothing is downloaded.

Layout over 8 simulated CPU devices, data x model = 2 x 4, Megatron style:
- data parallel: ``partitioner.pmap`` runs 2 replicas, each on its own half
  of the batch; gradients are averaged over replicas with ``lax.pmean``;
- tensor (model) parallel inside each replica: the sharded_jit functions
  split every weight 4 ways over the model dimension only, column then row
  (attention: query/key/value by heads, output projection by heads; MLP: the
  first matrix by hidden units, the second by its rows; the unembedding by
  vocabulary); the residual stream stays whole on the 4 model devices.
  Each device holds a quarter of the weights; a layer costs one all-reduce
  after attention and one after the MLP, as in Megatron-LM.

  python examples/transformer.py                 # ~1 minute on 2 CPU cores
  python examples/transformer.py --steps 500 --layers 4 --data 2 --model 4
  python examples/transformer.py --layout pipeline --stages 4 --layers 4

``--layout`` picks another layout of the same model on the same devices:
- ``fsdp``: FSDP / ZeRO-3 over all ``data x model`` devices: one
  sharded_jit step; every weight and its Adam moments split 8 ways
  (``sharding.fsdp_specs``), the batch too; each weight is gathered where
  the step uses it and its gradient reduce-scattered;
- ``fsdp_tp``: FSDP x tensor parallel on a (fsdp, tensor) = (data, model)
  grid, MaxText's default: Megatron's splits on the tensor axis and an
  FSDP split on the other (``sharding.fsdp_tp_specs``; ``W_out`` gets the
  transposed device order), the batch over fsdp;
- ``search``: the layout ``partitioner.search`` finds for the step (without
  activation constraints: the argument specs say it all), with its report;
- ``pipeline``: pipeline stages x tensor parallel, ``--stages`` x (the rest
  of the devices), one sharded_jit step: the blocks' weights are stacked
  along a leading layer dimension split over the stages (each stage's
  weights and Adam moments stay on its devices, split Megatron's way over
  its tensor devices) and run through ``partitioner.pipeline`` in
  ``--microbatches`` microbatches; only activations move between stages.
  ``--layers`` must be a multiple of ``--stages``.

The optimizer (Adam) and the loss (cross-entropy) come from optax; the
weights' specs come from rules on their names (``sharding.spec_tree``), one
rule list for the parameters and the optimizer state. It prints progress
(a tqdm bar on a terminal, plain lines otherwise: step, loss, tokens/s),
checks the first steps against an unsharded run, prints a sample of
generated text and saves a loss curve PNG when matplotlib is installed.
With ``--checkpoint_dir`` it saves the state every ``--checkpoint_every``
steps and after the last (``partitioner.Checkpointer``) and resumes from
the latest checkpoint there.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

_STEPS = flags.DEFINE_integer("steps", 500, "Training steps.")
_DATA = flags.DEFINE_integer("data", 2, "Devices along the batch (data) dimension.")
_MODEL = flags.DEFINE_integer("model", 4, "Devices along the model dimension (heads, MLP).")
_BATCH = flags.DEFINE_integer("batch", 16, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq", 64, "Characters per sequence.")
_WIDTH = flags.DEFINE_integer("width", 128, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 8, "Attention heads.")
_LAYERS = flags.DEFINE_integer("layers", 2, "Transformer layers.")
_LR = flags.DEFINE_float("lr", 3e-3, "Adam learning rate.")
_CHECK = flags.DEFINE_integer("check_steps", 3, "Steps re-run unsharded to check the losses match.")
_SAMPLE = flags.DEFINE_integer("sample", 200, "Characters of text to generate at the end (0: none).")
_PLOT = flags.DEFINE_string("plot", "transformer_loss.png", "Loss curve PNG (needs matplotlib; '' for none).")
_LAYOUT = flags.DEFINE_enum("layout", "data_model",
                            ["data_model", "fsdp", "fsdp_tp", "search", "pipeline"],
                            "data_model: pmap x Megatron; fsdp: ZeRO-3 over every device;"
                            " fsdp_tp: FSDP over --data x tensor parallel over --model;"
                            " search: the layout partitioner.search finds; pipeline:"
                            " --stages pipeline stages x tensor parallel inside each.")
_STAGES = flags.DEFINE_integer("stages", 2, "Pipeline stages (--layout pipeline); they divide --layers.")
_MICRO = flags.DEFINE_integer("microbatches", 4, "Pipeline microbatches (--layout pipeline).")
_PARTITIONER = flags.DEFINE_enum("partitioner", None, ["shardy", "gspmd"], "XLA partitioner.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 10, "Print the loss every this many steps (without a terminal).")
_CKPT_DIR = flags.DEFINE_string("checkpoint_dir", "", "Save the state here (partitioner.Checkpointer) and resume from it ('' for none).")
_CKPT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Steps between checkpoints.")


class Model:
  """The transformer for one data replica, Megatron-split over ``mp`` model
  partitions, with its Adam update (optax).

  Args:
    mp: devices along the model dimension.
    batch_split: devices along the batch inside the program (1 for a
      replica of partitioner.pmap; the FSDP degree for the fsdp layouts).
    width, heads, layers, seq, vocab: the model's size.
    lr: Adam learning rate.
    constrain: ``constrain(x, spec)`` applied to activations (specs count
      batch_split then model partitions); by default sharding.with_sharding_constraint (the benchmark
      passes jax's own over a ('data', 'model') mesh).
    stages, microbatches: with ``stages``, the blocks' weights are stacked
      along a leading layer dimension split ``stages`` ways and run through
      ``partitioner.pipeline`` (the same values as the unstacked model's).

  Attributes:
    param_parts, opt_parts: how each weight (and its Adam moments) is split.
    grads: ``(params, seqs) -> (loss, grads)``.
    update: ``(params, opt, grads) -> (params, opt)``: one Adam step.
    step: ``(params, opt, seqs) -> (params, opt, loss)``: both, unsplit.
  """

  def __init__(self, mp, *, width, heads, layers, seq, vocab, lr, constrain=None,
               batch_split=1, stages=0, microbatches=1):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import partitioner
    from sharding import PartitionSpec as P
    from sharding import spec_tree, with_sharding_constraint

    wsc = constrain or with_sharding_constraint
    d, h, t = width, heads, seq
    dh, f = d // h, 4 * d
    bs = batch_split
    resid = P(bs, 1, 1) if bs > 1 else None  # [batch, seq, width]: whole on model devices
    by_head = P(bs, 1, mp, 1)  # [batch, seq, heads, head_dim]
    by_unit = P(bs, 1, mp)     # [batch, seq, hidden units or vocabulary]

    def norm(x, scale):
      x = x - x.mean(-1, keepdims=True)
      return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-5) * scale

    def block(x, p):
      y = norm(x, p["ln1"])
      q, k, v = (wsc(jnp.einsum("btd,dhk->bthk", y, p[w]), by_head)  # column parallel
                 for w in ("wq", "wk", "wv"))
      scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / np.sqrt(dh)
      causal = jnp.tril(jnp.ones((t, t), bool))
      attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
      o = wsc(jnp.einsum("bhqs,bshk->bqhk", attn, v), by_head)
      x = wsc(x + jnp.einsum("bthk,hkd->btd", o, p["wo"]), resid)  # row parallel: all-reduce
      y = norm(x, p["ln2"])
      hidden = wsc(jax.nn.gelu(y @ p["w1"]), by_unit)  # column parallel
      return wsc(x + hidden @ p["w2"], resid)  # row parallel: all-reduce

    def forward(params, tokens):
      x = wsc(params["embed"][tokens] + params["pos"][None, :tokens.shape[1]], resid)
      if stages:  # stage s runs blocks s*L/S ... on its own devices
        x = partitioner.pipeline(lambda p, h: block(h, p), params["blocks"], x,
                                 microbatches=microbatches, stages=stages,
                                 param_parts=self.param_parts["blocks"])
      else:
        for p in params["blocks"]:
          x = block(x, p)
      return wsc(norm(x, params["ln"]) @ params["unembed"], by_unit)  # [b, t, vocab]

    def loss_fn(params, seqs):
      logits = forward(params, seqs[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, seqs[:, 1:]).mean()

    tx = optax.adam(lr)

    def update(params, opt, grads):
      updates, opt = tx.update(grads, opt, params)
      return optax.apply_updates(params, updates), opt

    def step(params, opt, seqs):
      loss, grads = jax.value_and_grad(loss_fn)(params, seqs)
      return (*update(params, opt, grads), loss)

    def init(key):
      def normal(key, shape, scale):
        return (jax.random.normal(key, shape) * scale).astype(jnp.float32)
      keys = iter(jax.random.split(key, 4 + 6 * layers))
      blocks = []
      for _ in range(layers):
        blocks.append({
            "ln1": jnp.ones(d), "ln2": jnp.ones(d),
            "wq": normal(next(keys), (d, h, dh), d ** -0.5),
            "wk": normal(next(keys), (d, h, dh), d ** -0.5),
            "wv": normal(next(keys), (d, h, dh), d ** -0.5),
            "wo": normal(next(keys), (h, dh, d), (2 * d * layers) ** -0.5),
            "w1": normal(next(keys), (d, f), d ** -0.5),
            "w2": normal(next(keys), (f, d), (2 * f * layers) ** -0.5)})
      params = {"embed": normal(next(keys), (vocab, d), 0.1),
                "pos": normal(next(keys), (t, d), 0.1),
                "ln": jnp.ones(d),
                "unembed": normal(next(keys), (d, vocab), d ** -0.5),
                "blocks": blocks}
      if stages:  # the same weights, stacked: one array of L layers per name
        params["blocks"] = jax.tree_util.tree_map(lambda *w: jnp.stack(w), *blocks)
      return params, tx.init(params)

    # Megatron: column-parallel weights split their output dimension (heads,
    # hidden units, vocabulary), row-parallel ones their input dimension.
    # The rules match the end of each leaf's path, so they cover the
    # parameters ("blocks/0/wq") and Adam's moments ("0/mu/blocks/0/wq").
    # Stacked blocks split their leading layer dimension over the stages too.
    lead = (stages,) if stages else ()
    self.rules = [(r"(wq|wk|wv)$", P(*lead, 1, mp, 1)),  # [width, heads, head_dim]
                  (r"wo$", P(*lead, mp, 1, 1)),          # [heads, head_dim, width]
                  (r"w1$", P(*lead, 1, mp)),             # [width, hidden]
                  (r"w2$", P(*lead, mp, 1)),             # [hidden, width]
                  # [width, vocabulary]; with stages, split over the devices
                  # of each stage (the pipeline's result is split over the
                  # stages along the batch: the logits stay where it is)
                  (r"unembed$", P(1, mp, grid=(stages, mp), axes=(None, 1))
                   if stages else P(1, mp)),
                  (r"ln[12]$", P(stages, 1) if stages else None),
                  (r".*", None)]                         # norms, embeddings: whole
    self.shapes = jax.eval_shape(init, jax.random.PRNGKey(0))
    self.param_parts, self.opt_parts = spec_tree(self.shapes, self.rules)
    self.init, self.forward, self.step, self.update = init, forward, step, update
    self.grads = jax.value_and_grad(loss_fn)


def train_step(model: Model):
  """The data x model train step: ``partitioner.pmap`` over the replicas
  (axis "data") of sharded_jit functions over the model partitions. Takes
  (params, opt, seqs of shape [replicas, batch / replicas, seq + 1])."""
  from jax import lax

  import partitioner
  from partitioner import sharded_jit

  grads = sharded_jit(model.grads, in_parts=(model.param_parts, None),
                      out_parts=(None, model.param_parts))
  update = sharded_jit(model.update,
                       in_parts=(model.param_parts, model.opt_parts, model.param_parts),
                       out_parts=(model.param_parts, model.opt_parts))

  def replica_step(params, opt, seqs):
    loss, g = grads(params, seqs)
    loss, g = lax.pmean((loss, g), "data")  # data parallel: average over replicas
    return (*update(params, opt, g), loss)

  # Parameters and the optimizer state are the same on every replica
  # (in_axes/out_axes None), split over the model partitions by the specs.
  return partitioner.pmap(replica_step, "data", in_axes=(None, None, 0), out_axes=None,
                          donate_argnums=(0, 1))


LAYOUT_NAMES = {"data_model": "data x model", "fsdp": "FSDP", "fsdp_tp": "FSDP x tensor",
                "pipeline": "pipeline stages x tensor"}


def fsdp_train_step(model: Model, fsdp: int, tensor: int):
  """The fsdp and fsdp_tp layouts' train step: one sharded_jit over
  ``fsdp x tensor`` devices. Parameters and Adam moments get FSDP specs
  (with the model's tensor-parallel rules when ``tensor > 1``); the batch
  is split ``fsdp`` ways. Takes (params, opt, seqs of shape [batch, seq + 1])."""
  from sharding import PartitionSpec as P
  from sharding import fsdp_specs, fsdp_tp_specs

  if tensor == 1:
    model.param_parts, model.opt_parts = fsdp_specs(model.shapes, fsdp)
  else:
    # MaxText splits the embedding table's vocabulary over tensor too.
    rules = [(r"(^|/)embed$", P(tensor, 1)), *model.rules]
    model.param_parts, model.opt_parts = fsdp_tp_specs(
        model.shapes, rules, fsdp=fsdp, tensor=tensor)
  return state_train_step(model, P(fsdp, 1))


def state_train_step(model: Model, batch_parts=None):
  """One sharded_jit step over the model's own specs (the pipeline layout's
  step; the fsdp layouts' once they set the specs), the batch split by
  ``batch_parts`` (None: every device holds it whole)."""
  from partitioner import sharded_jit

  state = (model.param_parts, model.opt_parts)
  return sharded_jit(model.step, in_parts=(*state, batch_parts), out_parts=(*state, None),
                     donate_argnums=(0, 1))


def main(argv):
  del argv
  n = _DATA.value * _MODEL.value
  from partitioner.launch import with_cpu_device_count
  os.environ["XLA_FLAGS"] = with_cpu_device_count(os.environ.get("XLA_FLAGS", ""), n)
  import logging
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  from pydoc_data import topics

  import jax
  import numpy as np
  # float32 matmuls run as TF32 on GPUs and as one bfloat16 pass on TPUs by
  # default: the comparison with the unsharded run needs full precision (a
  # no-op on CPU).
  jax.config.update("jax_default_matmul_precision", "highest")

  import partitioner

  if _PARTITIONER.value:
    partitioner.config.partitioner = _PARTITIONER.value
  dp, mp = _DATA.value, _MODEL.value
  layout = _LAYOUT.value
  if layout in ("fsdp", "search"):  # no tensor-parallel rules of ours
    dp, mp = n, 1
  d, h, layers, t, b = _WIDTH.value, _HEADS.value, _LAYERS.value, _SEQ.value, _BATCH.value
  by_batch = dp
  if layout == "pipeline":  # stages x tensor; the batch whole, cut into microbatches
    # (sharded_jit logs, at INFO, how it guards the slices of the pipeline's
    # lax.scan at the loop counter, a clamp that costs nothing: not shown)
    logging.getLogger("partitioner").setLevel(logging.WARNING)
    dp, by_batch = _STAGES.value, _MICRO.value
    mp = n // dp
    if n % dp or layers % dp:
      raise app.UsageError(f"--stages={dp} must divide the {n} devices and --layers={layers}")
  for what, size, by in (("heads", h, mp), ("batch", b, by_batch)):
    if size % by:
      raise app.UsageError(f"--{what}={size} must be divisible by {by}")

  # --- data: Python's own documentation, character by character -----------
  text = "\n".join(topics.topics.values())
  chars = sorted(set(text))
  vocab = -(-len(chars) // mp) * mp  # padded so the logits split evenly
  index = {c: i for i, c in enumerate(chars)}
  corpus = np.array([index[c] for c in text], dtype=np.int32)
  rng = np.random.default_rng(_SEED.value)

  def batch():
    starts = rng.integers(0, len(corpus) - t - 1, size=b)
    return np.stack([corpus[s:s + t + 1] for s in starts])

  sizes = dict(width=d, heads=h, layers=layers, seq=t, vocab=vocab, lr=_LR.value)
  if layout == "data_model":
    model = Model(mp, **sizes)
    step_fn = train_step(model)
    split = lambda seqs: seqs.reshape(dp, b // dp, t + 1)  # one row of sequences per replica
  elif layout == "pipeline":
    # No activation constraints: the model's specs count tiles over all the
    # devices, so the embedding's and the logits' would lie across the
    # stages, not inside each, and XLA would gather at the pipeline's edges
    # (inside layer_fn a constraint applies within each stage).
    model = Model(mp, constrain=lambda x, spec: x, stages=dp, microbatches=by_batch, **sizes)
    step_fn, split = state_train_step(model), lambda seqs: seqs
  elif layout == "search":  # chosen below, once there are parameters to show it
    model = Model(1, constrain=lambda x, spec: x, **sizes)
    step_fn, split = None, lambda seqs: seqs
  else:
    model = Model(mp, batch_split=dp, **sizes)
    step_fn = fsdp_train_step(model, dp, mp)
    split = lambda seqs: seqs

  params0, opt0 = model.init(jax.random.PRNGKey(_SEED.value))
  grid = f"{dp} x {mp} = {n} devices ({LAYOUT_NAMES.get(layout, layout)})"
  if step_fn is None:
    found = partitioner.search(model.step, params0, opt0, np.zeros((b, t + 1), np.int32))
    print(found.report(), flush=True)
    step_fn = found.sharded_jit(donate_argnums=(0, 1))
    grid = f"{n} devices (found by partitioner.search: {found.best.family})"
  size = sum(x.size for x in jax.tree_util.tree_leaves(params0))
  print(f"Transformer: {layers} layers, width {d}, {h} heads, {size / 1e6:.2f}M parameters,"
        f" {len(chars)} characters; {grid},"
        f" partitioner {partitioner.config.partitioner}", flush=True)

  seen = [batch() for _ in range(_STEPS.value)]  # the same batches when resuming
  params, opt = jax.tree_util.tree_map(np.asarray, (params0, opt0))
  checkpoints = (partitioner.Checkpointer(_CKPT_DIR.value, every=_CKPT_EVERY.value, keep=2)
                 if _CKPT_DIR.value else None)
  first = 0
  if checkpoints is not None:  # (the steps done so far; the state back as host arrays)
    state, first, _ = checkpoints.restore({"params": params, "opt": opt})
    params, opt = state["params"], state["opt"]
    if first:
      print(f"resumed from {_CKPT_DIR.value} after step {first - 1}", flush=True)
  losses = []
  progress = Progress(first, len(seen), b * t, _LOG_EVERY.value)
  for i in range(first, len(seen)):
    params, opt, loss = step_fn(params, opt, split(seen[i]))
    losses.append(float(loss))
    progress.update(i, losses[-1])
    if checkpoints is not None:  # (every --checkpoint_every steps, and the last)
      checkpoints.save(i + 1, {"params": params, "opt": opt}, force=i == len(seen) - 1)
  progress.close()
  if checkpoints is not None:
    checkpoints.close()
  if not losses:
    print("nothing to do: the checkpoint is already at the last step")
    return
  print(f"loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f} (mean of the last 10 steps)")
  print(explain_line(step_fn, params, opt, split(seen[0])))
  mine = sum(x.addressable_shards[0].data.nbytes for x in jax.tree_util.tree_leaves(params))
  whole = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
  print(f"parameter bytes per device: {mine / 1e6:.3f} MB of {whole / 1e6:.3f} MB"
        f" (1/{whole / mine:.1f})")

  # The same first steps unsharded, on the whole batch (constraints are the
  # identity in a program on one device): the losses must match. The
  # pipeline is checked against the plain model (its blocks in a Python
  # loop), from the same weights unstacked.
  plain_model = Model(mp, **sizes) if layout == "pipeline" else model
  if _CHECK.value and not first:
    plain = jax.jit(plain_model.step)
    (p, o), ref = plain_model.init(jax.random.PRNGKey(_SEED.value)), []
    for seqs in seen[:_CHECK.value]:
      p, o, loss = plain(p, o, seqs)
      ref.append(float(loss))
    diff = float(np.max(np.abs(np.array(losses[:len(ref)]) - ref)))
    ok = np.allclose(losses[:len(ref)], ref, rtol=1e-3, atol=1e-4)
    print(f"first {len(ref)} steps vs unsharded: max loss difference {diff:.1e}"
          f" ({'match' if ok else 'MISMATCH'})")
    if not ok:
      sys.exit(1)

  if _SAMPLE.value:
    if layout == "pipeline":  # the plain model's forward, on one sequence
      blocks = params["blocks"]
      params = {**params, "blocks": [jax.tree_util.tree_map(lambda w: w[i], blocks)
                                     for i in range(layers)]}
    print("Sample:\n" + sample(plain_model.forward, params, chars, index, t,
                               _SAMPLE.value, _SEED.value))
  if _PLOT.value:
    save_plot(losses, _PLOT.value)
  if len(losses) > 20 and not np.mean(losses[-10:]) < losses[0]:
    sys.exit(1)


class Progress:
  """Step, loss and tokens/s: a tqdm bar on a terminal, plain lines
  otherwise (every ``log_every`` steps, and the first and last)."""

  def __init__(self, first: int, total: int, tokens_per_step: int, log_every: int):
    self._first, self._total, self._tokens = first, total, tokens_per_step
    self._log_every = log_every
    self._start = time.perf_counter()
    self._bar = None
    if sys.stdout.isatty():
      from tqdm import tqdm
      self._bar = tqdm(total=total, initial=first, unit="step", dynamic_ncols=True)

  def update(self, i: int, loss: float) -> None:
    now = time.perf_counter()
    if i == self._first:  # tracing, partitioning and compiling: not a rate
      note = f"first step: trace, partition and compile, {now - self._start:.1f} s"
      self._start = now
    else:
      rate = (i - self._first) * self._tokens / (now - self._start)
      note = f"{rate:,.0f} tokens/s"
    if self._bar is not None:
      self._bar.set_postfix_str(f"loss {loss:.3f}  {note}", refresh=False)
      self._bar.update(1)
    elif i == self._first or i % self._log_every == 0 or i == self._total - 1:
      print(f"step {i:3d}/{self._total}  loss {loss:.4f}  {note}", flush=True)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()


def explain_line(step_fn, params, opt, seqs) -> str:
  import partitioner
  totals = partitioner.explain(step_fn, params, opt, seqs).collective_totals()
  used = ", ".join(f"{n} {k}" for k, (n, _) in totals.items() if n)
  return f"collectives per step (partitioner.explain): {used or 'none'}"


def sample(forward, params, chars, index, t, length, seed) -> str:
  """Generates text from the trained model, one character at a time."""
  import jax
  import numpy as np
  fwd = jax.jit(lambda p, x: forward(p, x)[0, -1])
  prompt = "The "
  ids = [index[c] for c in prompt]
  key = jax.random.PRNGKey(seed)
  for _ in range(length):
    window = np.array([([0] * t + ids)[-t:]], dtype=np.int32)
    logits = fwd(params, window)[:len(chars)]
    key, sub = jax.random.split(key)
    ids.append(int(jax.random.categorical(sub, logits / 0.8)))
  return "".join(chars[i] for i in ids)


def save_plot(losses, path) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print(f"(matplotlib is not installed: no {path})")
    return
  fig, ax = plt.subplots(figsize=(6, 3.5))
  ax.plot(losses)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats/char)")
  ax.set_title("transformer, partitioner.pmap (data) x sharded_jit (model)")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f"loss curve saved to {path}")


if __name__ == "__main__":
  app.run(main)
