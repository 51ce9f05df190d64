"""``python -m benchmarks.proxied_peaks``: the peaks a plan through
XLA:TPU reports for the layouts it ranks after its winner, against their
whole programs (libtpu installed; compile-only, nothing runs).

A search for compile-only v5p chips (``tpu_devices("v5p:2x2x2")``)
compiles each candidate as a proxy of its repeated layers and the winner
whole; the others carry their peaks counted from the jaxpr, marked
estimates (``memory["by"]``). Here each of them is compiled whole by
XLA:TPU (``found.choose(k)``) and its reported peak divided by the whole
program's. Models (``--model``), Llama-shaped decoders
(``benchmarks._llama``): ``decoder``, 8 layers of width 512, 8 query heads
over 2 key-value heads, 8 x 512 tokens (3 minutes); ``small``, the same at
4 layers (under a minute, 4 compiles); ``8b``, Llama 3 8B at 8 x 4096
tokens (about 15 minutes: a whole compile of the 8B takes a minute);
``gemma``, transformers' Flax Gemma at 6 layers (``benchmarks._gemma``,
the ``thirdparty`` extra; a minute), whose layouts with the rest sharded
store weights split on the model axis that no rule splits.
Prints one line per layout and the range.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from benchmarks._common import setup_jax


def _model(model: str) -> tuple:
  """``(step, state, tokens)`` of ``--model``, abstract."""
  from benchmarks import _llama
  if model == "gemma":
    import jax

    from benchmarks._gemma import gemma
    return gemma(jax, 6, abstract=True)
  decoder = _llama.Shape(layers=8, width=512, mlp=1536, heads=8, kv_heads=2, vocab=4096,
                         batch=8, seq=512)
  shape = {"8b": _llama.LLAMA3_8B, "decoder": decoder,
           "small": dataclasses.replace(decoder, layers=4)}[model]
  return _llama.abstract(shape)


def measure(model: str) -> tuple:
  """(the search's result, [(its index, the candidate, its whole
  program's peak)] for each layout ranked after the winner whose peak no
  compiler settled)."""
  setup_jax(8)
  import partitioner
  step, state, tokens = _model(model)
  chips = partitioner.tpu_devices("v5p:2x2x2")
  found = partitioner.search(step, *state, tokens, devices=chips, progress=False,
                             device_model="tpu-v5p",
                             **({"max_compiles": 4} if model in ("small", "gemma") else {}))
  rows = []
  for k, c in enumerate(found.candidates):
    if not k or c.error or c.fits is not None:  # (the winner, and peaks a compiler settled)
      continue
    whole = found.choose(k).sharded_jit(devices=chips, donate_argnums=(0, 1)).lower(
        *state, tokens).compile().cost().peak_memory
    rows.append((k, c, whole))
    print(f"#{k} {c.family}: reported {c.peak_memory / 2**30:.3f} GiB ({c.memory['by']}),"
          f" XLA:TPU's whole program {whole / 2**30:.3f} GiB: {c.peak_memory / whole:.2f}x",
          flush=True)
  return found, rows


def main(argv: list[str] | None = None) -> dict:
  """Runs it; the JSON it prints last, as a dict."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", choices=("decoder", "small", "8b", "gemma"), default="decoder")
  args = parser.parse_args(argv)
  found, rows = measure(args.model)
  ratios = [c.peak_memory / whole for _, c, whole in rows]
  summary = {"model": args.model, "search_seconds": round(found.search_seconds),
             "layouts": len(ratios),
             "reported_over_whole": [round(min(ratios), 2), round(max(ratios), 2)]
             if ratios else None}
  print(json.dumps(summary))
  return summary


if __name__ == "__main__":
  main()
