"""One rule for every front end: the same bad input gets the same rule and
message whether a sharded_jit function is called directly, under
partitioner.pmap (which says the spec applies per replica), under jax.jit or
nested in another sharded_jit."""

import jax
import numpy as np
import pytest

import partitioner
from partitioner import sharded_jit
from sharding import PartitionSpec as P


def double(x):
  return x * 2


def _front_ends(fn, shape):
  """fn called on an array of ``shape`` (per replica under pmap) by each
  front end."""
  x = np.ones(shape, np.float32)
  return {
      "sharded_jit": lambda: fn(x),
      "pmap": lambda: partitioner.pmap(fn)(np.stack([x, x])),
      "jax.jit": lambda: jax.jit(fn)(x),
      "nested": lambda: sharded_jit(lambda y: fn(y), in_parts=None, out_parts=None)(x),
  }


def _message(call) -> tuple[type, str]:
  with pytest.raises(Exception) as info:
    call()
  return type(info.value), str(info.value)


# What each front end says of the value before the rule; under pmap the
# spec applies per replica, and the message says so and names the shape passed.
_WHAT = "in_parts for argument `x` (args[0]) with shape (4, 6): "
_PER_REPLICA = ("partitioner.pmap(double): argument `x` (args[0]) has shape (2, 4, 6),"
                " i.e. (4, 6) per replica; in_parts for argument `x` (args[0]) applies"
                " per replica: ")


@pytest.mark.parametrize("parts,shape,rule", [
    # 6 does not divide by 4: pmap used to run it split 2 ways instead.
    (P(1, 4), (4, 6), "dimension 1 of shape (4, 6) has size 6, which is not divisible by"
                      " its partition count 4"),
    # The rank: the message names the argument, not a jax-internal frame.
    (P(2, 1, 1), (4, 6), "spec PartitionSpec(2, 1, 1) has 3 entries but the array has rank 2"),
])
def test_a_bad_spec_gets_one_rule_from_every_front_end(parts, shape, rule):
  fn = sharded_jit(double, in_parts=parts, out_parts=None)
  messages = {name: _message(call) for name, call in _front_ends(fn, shape).items()}
  rules = set()
  for name, (kind, text) in messages.items():
    what = _PER_REPLICA if name == "pmap" else _WHAT
    assert kind is ValueError, (name, kind, text)
    assert text.startswith(what + rule), (name, text)
    assert "jax/_src" not in text, (name, text)
    rules.add(text.removeprefix(what))
  assert len(rules) == 1, messages


def test_an_output_spec_that_does_not_divide_is_refused_inside_pmap_too():
  fn = sharded_jit(lambda x: x[:, :6], in_parts=None, out_parts=P(1, 4))
  direct = _message(lambda: fn(np.ones((4, 8), np.float32)))
  mapped = _message(lambda: partitioner.pmap(fn)(np.ones((2, 4, 8), np.float32)))
  assert direct[0] is mapped[0] is ValueError
  rule = ("dimension 1 of shape (4, 6) has size 6, which is not divisible by its"
          " partition count 4")
  assert direct[1].startswith("out_parts for output with shape (4, 6): " + rule), direct
  assert mapped[1].startswith("partitioner.pmap(<lambda>): out_parts for output applies"
                              " per replica, where the value has shape (4, 6): " + rule), mapped


@pytest.mark.parametrize("make,who", [
    (lambda: sharded_jit(double, in_parts=None, out_parts=None), "sharded_jit function double"),
    (lambda: partitioner.pmap(double), r"partitioner.pmap\(double\)"),
])
def test_argument_errors_name_the_front_end_called(make, who):
  f = make()
  x = np.ones((2, 3), np.float32)
  cases = [
      (lambda: f(x=x), TypeError, rf"^{who} got keyword arguments \['x'\]; it takes positional"
                                  " arguments only"),
      (lambda: f("text"), TypeError, rf"^{who}: argument `x` \(args\[0\]\) is a str \('text'\),"
                                     " not an array"),
      (lambda: f(np.array(["a", "b"])), TypeError, rf"^{who}: argument `x` \(args\[0\]\) is a numpy"
                                                   " array of dtype <U1"),
  ]
  for call, kind, error in cases:
    with pytest.raises(kind, match=error):
      call()


@pytest.mark.parametrize("make,who", [
    (lambda d: sharded_jit(double, in_parts=None, out_parts=None, donate_argnums=d),
     "sharded_jit function double"),
    (lambda d: partitioner.pmap(double, donate_argnums=d), r"partitioner.pmap\(double\)"),
])
def test_a_donation_that_cannot_happen_is_an_error_on_every_front_end(make, who):
  # Positions past the arguments: never ignored silently.
  with pytest.raises(ValueError, match=rf"^{who}: donate_argnums contains 5, but the function"
                                       r" was called with 1 positional argument\(s\)"):
    make(5)(np.ones((2, 3), np.float32))


def test_too_few_devices_is_one_rule():
  direct = sharded_jit(double, in_parts=P(16, 1), out_parts=None)
  mapped = partitioner.pmap(sharded_jit(double, in_parts=P(4, 1), out_parts=None))
  with pytest.raises(ValueError, match=r"^sharded_jit function double requires 16 devices,"
                                       r" but only 8 devices are available \(from"
                                       r" jax.local_devices\(\)\).*device_count=16"):
    direct(np.ones((16, 2), np.float32))
  with pytest.raises(ValueError, match=r"^partitioner.pmap\(double\) requires 16 devices \(4"
                                       r" replicas x 4 partitions\), but only 8 devices are"
                                       r" available \(from jax.local_devices\(\)\).*device_count=16"):
    mapped(np.ones((4, 8, 2), np.float32))


@pytest.mark.parametrize("make", [
    lambda d: sharded_jit(double, in_parts=None, out_parts=None, devices=d),
    lambda d: partitioner.pmap(double, devices=d),
])
def test_devices_are_checked_alike(make):
  with pytest.raises(ValueError, match=r"devices contains duplicates"):
    make([jax.devices()[0]] * 2)
  with pytest.raises(TypeError, match=r"devices must be a sequence of jax.Device"):
    make(jax.devices()[0])


def test_pmap_of_zero_replicas_is_an_error():
  with pytest.raises(ValueError, match=r"partitioner.pmap\(double\): argument `x` \(args\[0\]\)"
                                       r" has shape \(0, 3\), size 0 on its mapped axis 0: zero replicas"):
    partitioner.pmap(double)(np.ones((0, 3), np.float32))
