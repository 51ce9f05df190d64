"""sharding.spec_tree: spec trees from (pattern, spec) rules over key paths."""

import pickle
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from partitioner import explain, sharded_jit
from sharding import PartitionSpec as P
from sharding import spec_tree
from sharding._rules import RuleSpec, path_name, rule_of

PARAMS = {
    "embed": {"embedding": np.zeros((16, 8), np.float32)},
    "layers": [{"attn": {"wq": {"kernel": np.zeros((8, 8), np.float32),
                                "bias": np.zeros(8, np.float32)}},
                "mlp": {"kernel": np.zeros((8, 32), np.float32)}}],
}
RULES = [
    ("attn/.*/kernel", P(1, 4)),
    ("mlp/kernel", P(1, 4)),
    ("embedding", P(4, 1)),
    ("bias", None),
]


def _leaves(specs):
  return jax.tree_util.tree_leaves(specs, is_leaf=lambda x: x is None or isinstance(x, P))


def test_first_matching_rule_wins_and_structure_is_kept():
  rules = [("attn/wq/kernel", P(2, 1)), *RULES]
  got = spec_tree(PARAMS, rules)
  assert got == {"embed": {"embedding": P(4, 1)},
                 "layers": [{"attn": {"wq": {"kernel": P(2, 1), "bias": None}},
                             "mlp": {"kernel": P(1, 4)}}]}
  assert jax.tree_util.tree_structure(got, is_leaf=lambda x: x is None) == \
      jax.tree_util.tree_structure(PARAMS)


@pytest.mark.parametrize("path,name", [
    ((jax.tree_util.DictKey("layers"), jax.tree_util.SequenceKey(0),
      jax.tree_util.GetAttrKey("kernel")), "layers/0/kernel"),
    ((jax.tree_util.FlattenedIndexKey(3), jax.tree_util.DictKey(7)), "3/7"),
    ((), ""),
])
def test_path_names(path, name):
  assert path_name(path) == name


def test_one_rule_list_covers_params_and_their_optax_state():
  opt_state = optax.adam(1e-3).init(PARAMS)
  specs = spec_tree(opt_state, RULES)
  assert specs[0].count is None  # a scalar matching no rule is replicated
  assert specs[0].mu == specs[0].nu == spec_tree(PARAMS, RULES)
  f = sharded_jit(lambda p, s: jax.tree.map(lambda a, m: a + m, p, s[0].mu),
                  in_parts=(spec_tree(PARAMS, RULES), specs),
                  out_parts=spec_tree(PARAMS, RULES))
  out = f(PARAMS, opt_state)
  assert out["layers"][0]["attn"]["wq"]["kernel"].sharding.shard_shape((8, 8)) == (8, 2)
  assert out["embed"]["embedding"].sharding.shard_shape((16, 8)) == (4, 8)


def test_flax_nnx_state_and_its_optimizer_state():
  class Block(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(4, 8, rngs=rngs)
      self.down = nnx.Linear(8, 4, rngs=rngs)

  state = nnx.state(Block(nnx.Rngs(0)), nnx.Param)
  rules = [("up/kernel", P(1, 2)), ("down/kernel", P(2, 1)), ("up/bias", P(2)),
           ("bias", None)]
  specs = spec_tree(state, rules)
  paths = {path_name(p): s for p, s in jax.tree_util.tree_flatten_with_path(
      specs, is_leaf=lambda x: x is None or isinstance(x, P))[0]}
  assert paths == {"down/bias/value": None, "down/kernel/value": P(2, 1),
                   "up/bias/value": P(2), "up/kernel/value": P(1, 2)}
  opt_specs = spec_tree(optax.sgd(0.1, momentum=0.9).init(state), rules)
  assert _leaves(opt_specs) == _leaves(specs)
  f = sharded_jit(lambda s, x: x @ s["up"]["kernel"][...], in_parts=(specs, None),
                  out_parts=P(1, 2))
  assert f(state, np.ones((2, 4), np.float32)).sharding.num_devices == 2


def test_default_and_scalars():
  tree = {"w": np.zeros((4, 4)), "step": np.int32(0), "lr": 0.1}
  assert spec_tree(tree, [("w", P(2, 1))]) == {"w": P(2, 1), "step": None, "lr": None}
  assert spec_tree(tree, [], default=None) == {"w": None, "step": None, "lr": None}
  got = spec_tree({"w": np.zeros((4, 4))}, [], default=P(1, 2))
  assert got == {"w": P(1, 2)} and rule_of(got["w"]) == "default"


def test_shape_dtype_structs_and_none_leaves():
  tree = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32), "skip": None}
  assert spec_tree(tree, [("w", P(2, 1))]) == {"w": P(2, 1), "skip": None}


def test_compiled_patterns():
  assert spec_tree({"ab": np.zeros(2)}, [(re.compile("A", re.I), P(2))]) == {"ab": P(2)}


def test_rule_provenance():
  specs = spec_tree(PARAMS, RULES)
  kernel = specs["layers"][0]["attn"]["wq"]["kernel"]
  assert isinstance(kernel, RuleSpec) and kernel.rule == "rules[0] ('attn/.*/kernel')"
  assert kernel == P(1, 4) and P(1, 4) == kernel and hash(kernel) == hash(P(1, 4))
  assert repr(kernel) == "PartitionSpec(1, 4)" and {kernel: 1}[P(1, 4)] == 1
  assert rule_of(P(1, 4)) == "" and rule_of(None) == ""
  with pytest.raises(AttributeError, match="immutable"):
    kernel.rule = "other"
  assert type(pickle.loads(pickle.dumps(kernel))) is P


def test_explain_names_the_rule_of_each_argument():
  f = sharded_jit(lambda p: p["layers"][0]["mlp"]["kernel"] * 2,
                  in_parts=(spec_tree(PARAMS, RULES),), out_parts=P(1, 4))
  report = explain(f, PARAMS)
  by_name = {a.name.split("args[0])")[1]: a for a in report.arguments}
  mlp = by_name["['layers'][0]['mlp']['kernel']"]
  assert mlp.rule == "rules[1] ('mlp/kernel')"
  assert by_name["['layers'][0]['attn']['wq']['bias']"].rule == ""
  assert report.outputs[0].rule == ""
  text = str(report)
  assert ("['layers'][0]['mlp']['kernel']: float32[8, 32]  PartitionSpec(1, 4)  ->"
          "  float32[8, 8] per device (256 B)  from rules[1] ('mlp/kernel')") in text


def _error(call):
  with pytest.raises((TypeError, ValueError)) as info:
    call()
  return type(info.value), str(info.value)


@pytest.mark.parametrize("what,call,kind,pattern", [
    ("no rule", lambda: spec_tree(PARAMS, RULES[:2]), ValueError,
     r"no rule matches 'embed/embedding' \(float32\[16, 8\]\); the patterns are"
     r" \['attn/\.\*/kernel', 'mlp/kernel'\]\. Hint: add a rule.*default=None"),
    ("rank", lambda: spec_tree(PARAMS, [("kernel|bias", P(1, 4)), (".*", None)]), ValueError,
     r"rules\[0\] \('kernel\|bias'\) gives PartitionSpec\(1, 4\) to"
     r" 'layers/0/attn/wq/bias', but that leaf has rank 1 \(float32\[8\]\), not 2"),
    ("scalar with a rank-1 rule", lambda: spec_tree({"count": np.int32(0)}, [(".*", P(2))]),
     ValueError, r"'count', but that leaf has rank 0 \(int32\[\]\)"),
    ("default rank", lambda: spec_tree(PARAMS, [], default=P(2)), ValueError,
     r"default gives PartitionSpec\(2\) to 'embed/embedding'"),
    ("pattern int", lambda: spec_tree(PARAMS, [("bias", None), (3, P(2))]), TypeError,
     r"the pattern of rules\[1\] must be a str or a compiled regular expression, got 3"),
    ("spec tuple", lambda: spec_tree(PARAMS, [("bias", (1, 4))]), TypeError,
     r"spec_tree rules\[0\] \('bias'\): expected a sharding.PartitionSpec or None, got \(1, 4\)"),
    ("jax spec", lambda: spec_tree(PARAMS, [("bias", jax.P("x"))]), TypeError,
     r"rules\[0\].*partition counts"),
    ("not a pair", lambda: spec_tree(PARAMS, [("bias",)]), TypeError,
     r"rules\[0\] must be a \(pattern, spec\) pair"),
    ("rules a dict", lambda: spec_tree(PARAMS, {"bias": None}), TypeError,
     r"rules must be a sequence of \(pattern, spec\) pairs, got a dict"
     r" \(pass list\(rules.items\(\)\)\)"),
    ("bad regex", lambda: spec_tree(PARAMS, [("(", None)]), ValueError,
     r"the pattern of rules\[0\], '\(', is not a valid regular expression"),
    ("bad default", lambda: spec_tree(PARAMS, [], default=2), TypeError,
     r"spec_tree default: expected a sharding.PartitionSpec or None, got 2"),
])
def test_errors(what, call, kind, pattern):
  got_kind, message = _error(call)
  assert got_kind is kind and re.search(pattern, message), (what, message)


def test_errors_never_print_values():
  values = {"w": np.full((64, 64), 123.456, np.float32)}
  _, message = _error(lambda: spec_tree(values, []))
  assert "123.4" not in message and "float32[64, 64]" in message
  _, message = _error(lambda: spec_tree(values, [("w", P(2))]))
  assert "123.4" not in message and len(message) < 400


def test_a_rule_may_give_an_open_spec():
  tree = {"w": np.zeros((8, 4, 2)), "b": np.zeros((8,))}
  specs = spec_tree(tree, [("w|b", P(2, ...))])
  assert specs["w"] == P(2, 1, 1) and specs["b"] == P(2)
