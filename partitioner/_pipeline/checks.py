"""partitioner.pipeline's checks of its arguments and its stage buffer's layout.

Each check raises a clear error naming the value and the numbers; the
stage buffer's spec lies on one device grid with the weights' stage split
and ``x``'s own spec (``_state_spec``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.core import Tracer

from sharding import _layout
from sharding._checks import positive_count
from sharding._partition_spec import PartitionSpec, with_layout
from sharding._spec_tree import check_spec, reject_auto


def count(value: Any, name: str) -> int:
  """``value`` as a positive int, or an error naming ``name``."""
  return positive_count(value, f"partitioner.pipeline: {name}",
                        hint=f"give {name} as a whole number of at least 1.")


def layers(layer_params: Any) -> tuple[int, list]:
  """L, the shared leading dimension of every leaf, and the leaves."""
  return leading(layer_params, "partitioner.pipeline", "layer_params", "layer dimension L",
                 "stack every weight over the same layers, one value per layer")


def leading(tree: Any, where: str, arg: str, dim: str, hint: str) -> tuple[int, list]:
  """The leading dimension ``dim`` (its name and symbol: ``"layer dimension
  L"``) that every leaf of ``tree`` (the argument ``arg`` of the call
  ``where``) shares, and the leaves as arrays; each error names the leaf
  and its shape."""
  symbol = dim.split()[-1]
  path_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  if not path_leaves:
    raise ValueError(f"{where}: {arg} has no arrays. Hint: {hint}.")
  leaves, first = [], None
  for path, w in path_leaves:
    name = f"{arg}{jax.tree_util.keystr(path)}"
    w = w if isinstance(w, jax.Array | Tracer) else jnp.asarray(w)
    if w.ndim < 1:
      raise ValueError(f"{where}: {name} is a scalar (shape ()), with no leading {dim}."
                       f" Hint: {hint}.")
    if first is None:
      first = (name, w.shape)
    elif w.shape[0] != first[1][0]:
      raise ValueError(
          f"{where}: every leaf of {arg} needs the same leading {dim}, but {first[0]} has"
          f" shape {tuple(first[1])} ({symbol} = {first[1][0]}) and {name} has shape"
          f" {tuple(w.shape)} ({symbol} = {w.shape[0]}). Hint: {hint}.")
    leaves.append(w)
  return leaves[0].shape[0], leaves


def stages(stages: int | None, param_specs: list | None, leaves: list,
           num_layers: int, repeats: int = 1, num_devices: int | None = None) -> int:
  """S: ``stages``, else the leading count of ``param_parts`` (or of the
  enclosing sharded_jit's ``in_parts``), checked against the devices the
  program may use (``num_devices``: the enclosing sharded_jit's
  ``devices=``, a compile-only topology's; None: jax's)."""
  leads = set()
  for spec, w in zip(param_specs or [], leaves):
    reject_auto([spec], ["layer_params"], "partitioner.pipeline param_parts")
    if spec is None:
      raise ValueError(
          "partitioner.pipeline: param_parts must split the layer dimension of"
          f" every leaf into the stages, got None for a leaf of shape"
          f" {tuple(w.shape)}. Hint: give each leaf a spec like PartitionSpec(S, ...).")
    spec.for_rank(w.ndim).check_shape(w.shape, "partitioner.pipeline param_parts",
                                      divisible=False)
    leads.add(spec[0])
  if len(leads) > 1:
    raise ValueError(f"partitioner.pipeline: param_parts split the layer dimension"
                     f" {sorted(leads)} ways; every leaf needs the same count (S).")
  if stages is None and not leads:
    raise ValueError(
        "partitioner.pipeline needs the number of stages: it reads it from the"
        " enclosing sharded_jit's in_parts for layer_params that are its"
        " inputs as they are (not computed inside the function, and not under"
        " jax.checkpoint or jax.vmap, which trace them anew). Hint: pass"
        " stages=S, or param_parts= with the specs in_parts gives them.")
  s = count(next(iter(leads)) if stages is None else stages, "stages")
  if leads and s not in leads:
    raise ValueError(f"partitioner.pipeline: stages={s}, but param_parts split the"
                     f" layer dimension {leads.pop()} ways. Hint: make them agree.")
  if num_layers % (s * repeats):
    per = "L / S consecutive layers" if repeats == 1 else \
        f"{repeats} (repeats) chunks of L / (S * repeats) layers"
    raise ValueError(
        f"partitioner.pipeline: stages={s}" + (f" x repeats={repeats}" if repeats > 1
                                               else "") +
        f" must divide the number of layers L = {num_layers} (the leading"
        f" dimension of layer_params); each stage holds {per}. Hint: use a"
        f" divisor of {num_layers}.")
  available = len(jax.devices()) if num_devices is None else num_devices
  if s > available:
    raise ValueError(
        f"partitioner.pipeline: stages={s} needs {s} devices, one stage each,"
        f" but only {available} devices are available. Hint: use at"
        f" most {available} stages.")
  return s


def from_inputs(tracing: Any, leaves: list) -> list | None:
  """The specs the enclosing sharded_jit's ``in_parts`` gives the leaves
  (all of them inputs as they are; a leaf it leaves whole: a spec of one
  stage), or None when one is not an input."""
  if tracing is None:
    return None
  found = [tracing.spec_of(w) for w in leaves]
  if not all(known for known, _ in found):
    return None
  return [PartitionSpec(*(1,) * w.ndim) if spec is None else spec
          for w, (_, spec) in zip(leaves, found)]


def data_split(param_specs: list, ndim: int, mb: int, n: int) -> PartitionSpec | None:
  """For a pipeline whose stages are read from ``in_parts``: x's spec that
  splits the batch over the grid axes every stacked leaf leaves whole (the
  data axes of a grid like ``(stages, data, model)``), so the devices of
  those axes each run their own rows instead of all running the same
  microbatch. None when the leaves use every axis, their grids cut across
  each other, or the product does not divide the microbatch ``mb``; ``n``:
  the program's devices."""
  grid: _layout.Layout | None = None
  for spec in param_specs:
    layout = spec.layout if spec.layout is not None else (
        _layout.row_major(spec.counts, n) if n % spec.total == 0 else None)
    if layout is None or layout.total != n:
      return None
    if grid is None:
      grid = _layout.Layout(layout.sizes, (tuple(a for d in layout.dims for a in d),))
      continue
    common = _common_grid(grid, layout)
    if common is None:
      return None
    sizes, (used,), dims = common
    grid = _layout.Layout(sizes, (tuple(sorted({*used, *(a for d in dims for a in d)})),))
  if grid is None:
    return None
  free = tuple(a for a in range(len(grid.sizes)) if a not in grid.dims[0])
  blocks = math.prod(grid.sizes[a] for a in free)
  if blocks == 1 or mb % blocks:
    return None
  layout = _layout.canonical(grid.sizes, [free] + [()] * (ndim - 1))
  ids = {sp.device_ids for sp in param_specs if sp.device_ids is not None}
  return with_layout((blocks,) + (1,) * (ndim - 1),
                     None if _layout.is_row_major(layout) else layout,
                     ids.pop() if len(ids) == 1 else None)


def batch(x: jax.Array, m: int) -> None:
  """M divides the batch (dimension 0 of ``x``)."""
  if x.ndim < 1 or x.shape[0] % m:
    raise ValueError(
        f"partitioner.pipeline: microbatches={m} must divide the batch (dimension 0"
        f" of x, shape {tuple(x.shape)}). Hint: use a divisor of"
        f" {x.shape[0] if x.ndim else 'a batch dimension'}, or pad the batch.")


def circular(r: int, m: int, s: int, name: str = "partitioner.pipeline") -> None:
  """With repeats, at least as many microbatches as stages."""
  if r > 1 and m < s:
    raise ValueError(
        f"{name}: repeats={r} needs at least as many microbatches as"
        f" stages (microbatches={m}, stages={s}): a microbatch's next pass starts"
        f" at stage 0 when it leaves stage {s - 1}. Hint: microbatches >= {s}.")


def groups(schedule: Any) -> None:
  """Interleaved 1F1B runs its microbatches in groups of S: S divides M."""
  s, m, r = schedule.stages, schedule.microbatches, schedule.repeats
  if r > 1 and m % s:
    raise ValueError(
        f"partitioner.pipeline_grad: repeats={r} (interleaved 1F1B) runs the microbatches"
        f" in groups of stages={s}, each group's passes one after another, and"
        f" microbatches={m} is not a multiple of {s}. Hint: microbatches="
        f"{(m // s + 1) * s} (a multiple of the stages), or repeats=1.")


def check_layer_fn(layer_fn: Callable, layer_params: Any, h: jax.ShapeDtypeStruct) -> None:
  """``layer_fn`` on one layer's weights and one microbatch returns h's type."""
  one = jax.tree_util.tree_map(lambda w: jax.ShapeDtypeStruct(w.shape[1:], w.dtype),
                               layer_params)
  out = jax.eval_shape(layer_fn, one, h)
  if not isinstance(out, jax.ShapeDtypeStruct):
    raise TypeError(f"partitioner.pipeline: layer_fn must return one array (the next"
                    f" h), got {jax.tree_util.tree_structure(out)}.")
  if out.shape != h.shape or out.dtype != h.dtype:
    raise ValueError(
        f"partitioner.pipeline: layer_fn must return h's shape and dtype, but on"
        f" a microbatch {h.dtype.name}{list(h.shape)} it returns"
        f" {out.dtype.name}{list(out.shape)}. Hint: each layer maps h to a new"
        " h of the same type (cast, or project back to its width).")


def state_spec(param_specs: list | None, x_parts: Any, ndim: int, s: int,
                mb: int) -> tuple[PartitionSpec, PartitionSpec | None]:
  """The stage buffer's spec (S, microbatch, ...) and x's own (or None)."""
  stage = None if not param_specs else param_specs[0]
  x_spec = check_spec(x_parts, "partitioner.pipeline x_parts")
  reject_auto([x_spec], ["x"], "partitioner.pipeline x_parts")
  x_spec = None if x_spec is None else x_spec.for_rank(ndim)
  if x_spec is not None:
    x_spec.check_shape((1,) * ndim, "partitioner.pipeline x_parts", divisible=False)
    if mb % x_spec[0]:
      raise ValueError(
          f"partitioner.pipeline: x_parts {x_spec!r} splits the batch {x_spec[0]}"
          f" ways, which must divide the microbatch size {mb} (the batch /"
          " microbatches). Hint: use fewer microbatches or a larger batch.")
  counts = (s, *(x_spec.counts if x_spec is not None else (1,) * ndim))
  layouts = [sp.layout for sp in (stage, x_spec) if sp is not None and sp.layout]
  ids = {sp.device_ids for sp in (stage, x_spec)
         if sp is not None and sp.device_ids is not None}
  if len(ids) > 1:
    raise ValueError("partitioner.pipeline: param_parts and x_parts name different"
                     f" devices {sorted(ids)}. Hint: build both from one mesh.")
  if not layouts:
    if x_spec is not None and x_spec.is_partitioned and s > 1:
      raise ValueError(
          f"partitioner.pipeline: x_parts {x_spec!r} splits x row-major, so its"
          f" tiles lie along the same (major) devices as the {s} stages. Hint:"
          " give it a device order with the stages major, e.g. for a batch"
          f" split D ways: PartitionSpec(D, ..., grid=({s}, D), axes=(1,)).")
    return PartitionSpec(*counts, device_ids=ids.pop() if ids else None), x_spec
  n = layouts[0].total

  def as_layout(spec: PartitionSpec) -> _layout.Layout | None:
    if spec.layout is not None:
      return spec.layout if spec.layout.total == n else None
    return _layout.row_major(spec.counts, n) if n % spec.total == 0 else None

  a = as_layout(stage if stage is not None else PartitionSpec(s))
  b = as_layout(x_spec if x_spec is not None else PartitionSpec(*(1,) * ndim))
  grid = None if a is None or b is None else _common_grid(a, b)
  dims = None if grid is None else (grid[1][0], *grid[2])
  if grid is None or dims is None or len({*sum(dims, ())}) != len(sum(dims, ())):
    raise ValueError(
        f"partitioner.pipeline: the stage split of param_parts ({stage!r}) and"
        f" x_parts ({x_spec!r}) do not lie on one device grid with the stages on"
        " axes of their own. Hint: give both the same grid=, e.g. grid=(S, D),"
        " the layer dimension axes=0 and the batch axes=1.")
  layout = _layout.canonical(grid[0], dims)
  return with_layout(counts, None if _layout.is_row_major(layout) else layout,
                     ids.pop() if ids else None), x_spec


def _common_grid(a: _layout.Layout, b: _layout.Layout) -> tuple | None:
  """One grid finer than both layouts' grids (over the same devices), and
  each layout's dimensions on it, or None when their axes cut across."""
  def cuts(sizes: tuple[int, ...]) -> list[int]:
    strides = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
    return [*strides, math.prod(sizes)]

  points = sorted(set(cuts(a.sizes)) | set(cuts(b.sizes)), reverse=True)
  if any(hi % lo for hi, lo in zip(points, points[1:])):
    return None
  sizes = tuple(hi // lo for hi, lo in zip(points, points[1:]))

  def remap(layout: _layout.Layout) -> list[tuple[int, ...]]:
    strides = cuts(layout.sizes)
    inside = lambda i: tuple(j for j in range(len(sizes))
                             if strides[i] <= points[j + 1] < strides[i] * layout.sizes[i])
    return [tuple(j for i in axes for j in inside(i)) for axes in layout.dims]

  return sizes, remap(a), remap(b)

