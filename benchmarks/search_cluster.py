"""A cluster planned from one machine: partitioner.search on the Gemma
decoder of ``search_models`` (``benchmarks._gemma``) at the size of Gemma 2B (d_model 2048, MLP
16384, 8 query heads of 256 sharing one key/value head, vocabulary
256000; 4 of its 18 layers: the layers are one decision), an AdamW step
on 64 sequences of 1024 tokens, for 8 hosts of 8 H100s, from 64 simulated
CPU devices (``num_devices=64, hosts=8, device_model="h100"``; the
weights are shapes only: a plan never runs), against Megatron 8 x 8
written by hand (the model axis inside a host). (The 8-device sections'
d_model-256 model is no job for 64 H100s: its many small all-reduces are
latency-bound, and the plan keeps the model axis to fewer weights.)

Runs in a child process (``python -m benchmarks.search_cluster``): the
parent's jax has 8 devices. Reported: the search's time (cold) and the
found layout's time on the network per step (its bytes across hosts at
the network's rate, each collective across at its latency) against
Megatron 8 x 8's, both scored by ``partitioner.cost`` with ``hosts=8``
under the H100 model; within 1% counts as little (the search takes the
faster of layouts within ``QUIET_WITHIN`` of the least there)."""

from __future__ import annotations

import json
import time

from benchmarks._common import child_rows, network_seconds, setup_jax

LAYERS, DEVICES, HOSTS = 4, 64, 8
SIZE = dict(vocab_size=256000, hidden_size=2048, intermediate_size=16384, num_attention_heads=8,
            num_key_value_heads=1, head_dim=256)  # Gemma 2B's
BATCH, SEQ = 64, 1024
TIMEOUT = 1200


def rows() -> list[dict]:
  """The section's rows, from a child process of 64 devices."""
  return child_rows("benchmarks.search_cluster", timeout=TIMEOUT)


def main() -> None:
  jax = setup_jax(DEVICES)
  import partitioner
  from benchmarks._gemma import gemma, megatron_rules
  from partitioner import sharded_jit
  from sharding import PartitionSpec as P
  from sharding import fsdp_tp_specs

  step, state, ids = gemma(jax, LAYERS, SIZE, BATCH, SEQ, abstract=True)
  abstract = (*state, ids)
  partitioner.clear_caches()
  start = time.perf_counter()
  found = partitioner.search(step, *abstract, num_devices=DEVICES, hosts=HOSTS,
                             device_model="h100", progress=False)
  seconds = time.perf_counter() - start
  m = DEVICES // HOSTS
  specs = fsdp_tp_specs(state, megatron_rules(m), fsdp=HOSTS, tensor=m, min_size=1 << 60)
  megatron = sharded_jit(step, in_parts=(*specs, P(HOSTS, 1)), out_parts=(*specs, None))
  theirs = megatron.lower(*abstract).compile().cost("h100", hosts=HOSTS)
  best = found.best
  name = (f"Gemma 2B's size, {LAYERS} layers, {HOSTS} hosts x {m} (64 simulated devices,"
          " H100 model)")
  detail = (f"found: {best.family}, grid (data, fsdp, model) {tuple(best.grid)}, {best.layout};"
            f" {found.compiled} compiled of {found.estimated} estimated")
  print(json.dumps([
      {"case": f"{name}: search time (cold)", "unit": "s", "ours": seconds, "jax": 300.0,
       "against": "5 minutes", "target": "<= 1.0", "detail": detail},
      {"case": f"{name}: time on the network vs Megatron {HOSTS} x {m}", "unit": "ms",
       "ours": network_seconds(best) * 1e3, "jax": network_seconds(theirs) * 1e3,
       "against": f"Megatron {HOSTS} x {m}", "target": "<= 1.01",  # (the search's QUIET_WITHIN)
       "detail": f"across hosts {best.network_bytes / 2**20:.4g} MiB in"
                 f" {best.network_collectives} collective(s), Megatron {HOSTS} x {m}"
                 f" {theirs.network_bytes / 2**20:.4g} MiB in {theirs.network_collectives};"
                 f" estimated {best.seconds * 1e3:.3g} ms a step, Megatron {HOSTS} x {m}"
                 f" {theirs.seconds * 1e3:.3g} ms"}]))


if __name__ == "__main__":
  main()
