"""Every bad input a user can give, one line each: a clear error or the right answer.

Each row is (what, call, expected). ``expected`` is ``(ExceptionType,
regex)``: the call raises that type with a message matching the regex (which
names the argument or setting), never an internal message; or ``OK(value)``:
the call returns ``value``. Bigger scenarios with their own test live in
test_error_scenarios.py.
"""

import math
import os
import re
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from partitioner import Config, config, explain, pmap, sharded_jit
from sharding import PartitionSpec as P
from sharding import global_shape, local_shape, local_spec, tiling
from sharding import with_sharding_constraint as wsc

X = np.arange(32, dtype=np.float32).reshape(8, 4)
W = np.ones((4, 4), np.float32)
D = jax.devices()


class OK:
  def __init__(self, value):
    self.value = value


def sj(f=lambda x: x, i=P(2, 1), o=P(2, 1), **kw):
  return sharded_jit(f, in_parts=i, out_parts=o, **kw)


def env(**variables):
  return Config({f"SHARDED_JIT_{k.upper()}": v for k, v in variables.items()})


def setting(**kw):
  for name, value in kw.items():
    setattr(config, name, value)  # raises before changing anything


NAMED = r"argument `x` \(args\[0\]\)"
CASES = [
    # --- PartitionSpec ----------------------------------------------------------
    ("spec zero", lambda: P(0, 1), (ValueError, r"entry 0 of \(0, 1\) must be a positive int, got 0\..*Hint:.*use 1")),
    ("spec negative", lambda: P(2, -1), (ValueError, r"entry 1 of \(2, -1\) must be a positive int, got -1")),
    ("spec float", lambda: P(1.5), (TypeError, r"positive int, got 1.5.*Hint")),
    ("spec axis name", lambda: P("data", 1), (TypeError, r"got 'data'.*Mesh axis names belong to jax.sharding.PartitionSpec")),
    ("spec None entry", lambda: P(None, 2), (TypeError, r"entry 0 of \(None, 2\) must be a positive int, got None.*None instead of the whole spec")),
    ("spec bool", lambda: P(True), (TypeError, r"got True")),
    ("spec numpy int ok", lambda: P(np.int64(2), 1).counts, OK((2, 1))),
    ("spec is immutable", lambda: setattr(P(2), "counts", (4,)), (AttributeError, "immutable")),
    # --- sharded_jit(...) arguments -----------------------------------------------
    ("fun not callable", lambda: sharded_jit(5, None, None), (TypeError, "expects a callable, got 5")),
    ("in_parts str", lambda: sj(i="2,1"), (TypeError, r"in_parts: expected a sharding.PartitionSpec or None, got '2,1'")),
    ("in_parts int", lambda: sj(i=2), (TypeError, r"in_parts: .*got 2 of type int. Hint: write PartitionSpec\(2\)")),
    ("in_parts jax spec", lambda: sj(i=jax.sharding.PartitionSpec("x")), (TypeError, "partition counts")),
    ("in_parts tuple of ints", lambda: sj(i=(2, 1)), (TypeError, r"in_parts\[0\]: expected.*got 2")),
    ("in_parts dict of str", lambda: sj(i={"w": "x"}), (TypeError, r"in_parts\['w'\]: expected")),
    ("out_parts str", lambda: sj(o="x"), (TypeError, "out_parts: expected a sharding.PartitionSpec or None, got 'x'")),
    ("out_parts number", lambda: sj(o=1.0), (TypeError, "out_parts: expected.*got 1.0")),
    ("static_argnums str", lambda: sj(static_argnums="0"), (TypeError, "static_argnums must be an int or a sequence of ints, got '0'")),
    ("static_argnums float", lambda: sj(static_argnums=1.0), (TypeError, "static_argnums must be an int or a sequence of ints, got 1.0")),
    ("static_argnums bool", lambda: sj(static_argnums=True), (TypeError, "static_argnums must be an int")),
    ("static_argnums list of str", lambda: sj(static_argnums=["a"]), (TypeError, r"static_argnums must be.*\['a'\]")),
    ("donate_argnums str", lambda: sj(donate_argnums="0"), (TypeError, "donate_argnums must be an int or a sequence of ints")),
    ("donate_argnums None entry", lambda: sj(donate_argnums=[None]), (TypeError, "donate_argnums must be")),
    ("static and donate overlap", lambda: sj(static_argnums=0, donate_argnums=0), (ValueError, "overlap: a static argument has no buffer to donate")),
    ("num_partitions zero", lambda: sj(num_partitions=0), (ValueError, "num_partitions must be a positive int or None, got 0")),
    ("num_partitions negative", lambda: sj(num_partitions=-2), (ValueError, "num_partitions must be a positive int or None, got -2")),
    ("num_partitions float", lambda: sj(num_partitions=2.0), (TypeError, "num_partitions must be a positive int or None, got 2.0")),
    ("num_partitions str", lambda: sj(num_partitions="2"), (TypeError, "num_partitions must be a positive int or None, got '2'")),
    ("num_partitions bool", lambda: sj(num_partitions=True), (TypeError, "got True")),
    ("local_num_partitions zero", lambda: sj(local_num_partitions=0), (ValueError, "local_num_partitions must be a positive int")),
    ("devices one device", lambda: sj(devices=D[0]), (TypeError, r"devices must be a sequence of jax.Device \(e.g. jax.devices\(\)\[:4\]\), got \w*Device")),
    ("devices empty", lambda: sj(devices=[]), (TypeError, "devices must be a non-empty sequence of jax.Device, got ()")),
    ("devices strings", lambda: sj(devices=["cpu:0", "cpu:1"]), (TypeError, "devices must be a non-empty sequence of jax.Device")),
    ("devices ints", lambda: sj(devices=[0, 1]), (TypeError, "devices must be a non-empty sequence of jax.Device")),
    ("devices duplicated", lambda: sj(devices=[D[0], D[0]]), (ValueError, "devices contains duplicates")),
    ("devices too few", lambda: sj(devices=D[:1])(X), (ValueError, r"requires 2 devices, but only 1 devices are available \(from devices=\)")),
    ("devices a subset ok", lambda: sj(devices=D[-2:])(X).sharding.device_set == set(D[-2:]), OK(True)),
    # --- call arguments ------------------------------------------------------------
    ("too few arguments", lambda: sj(lambda x, y: x)(X), (TypeError, r"missing 1 required positional argument: 'y'")),
    ("too many arguments", lambda: sj()(X, X), (TypeError, r"takes 1 positional argument but 2 were given")),
    ("no arguments", lambda: sj()(), (TypeError, r"missing 1 required positional argument: 'x'")),
    ("keyword arguments", lambda: sj()(x=X), (TypeError, r"keyword arguments \['x'\].*positional arguments only")),
    ("too few arguments, a spec each", lambda: sj(lambda x, w: x @ w, i=(P(2, 1), None))(X), (TypeError, r"sharded_jit function <lambda>: missing 1 required positional argument: 'w'\. Hint: pass the arguments")),
    ("too many arguments, a spec each", lambda: sj(lambda x, w: x @ w, i=(P(2, 1), None))(X, W, W), (TypeError, r"<lambda>: takes 2 positional arguments but 3 were given")),
    ("lower without arguments", lambda: sj(lambda x, w: x @ w, i=(P(2, 1), None)).lower(), (TypeError, r"missing 2 required positional arguments: 'x' and 'w'\. Hint.*ShapeDtypeStruct")),
    ("a default left out ok", lambda: np.asarray(sj(lambda x, k=2.0: x * k)(X)).tolist(), OK((X * 2).tolist())),
    ("too many with a default", lambda: sj(lambda x, k=2.0: x * k)(X, X, X), (TypeError, r"takes from 1 to 2 positional arguments but 3 were given")),
    ("varargs ok", lambda: np.asarray(sj(lambda *xs: xs[0] + xs[1], i=(P(2, 1), P(2, 1)))(X, X)).tolist(), OK((X * 2).tolist())),
    ("pmap too few arguments", lambda: pmap(lambda x, w: x * w)(X), (TypeError, r"missing 1 required positional argument: 'w'")),
    ("pmap too few, an axis each", lambda: pmap(lambda x, w: x * w, in_axes=(0, None))(X), (TypeError, r"partitioner.pmap\(<lambda>\): missing 1 required positional argument: 'w'\. Hint")),
    ("pmap without arguments", lambda: pmap(lambda x, w: x * w)(), (TypeError, r"partitioner.pmap\(<lambda>\): missing 2 required positional arguments: 'x' and 'w'")),
    ("pmap too many arguments", lambda: pmap(lambda x, w: x * w)(X, X, X), (TypeError, r"partitioner.pmap\(<lambda>\): takes 2 positional arguments but 3 were given")),
    ("str argument", lambda: sj(i=None, o=None)("abc"), (TypeError, NAMED + r" is a str \('abc'\), not an array.*static_argnums")),
    ("bytes argument", lambda: sj(i=None, o=None)(b"ab"), (TypeError, NAMED + r" is a bytes")),
    ("object argument", lambda: sj(i=None, o=None)(object()), (TypeError, NAMED + r" is a object")),
    ("function argument", lambda: sj(i=None, o=None)(len), (TypeError, NAMED + r" is a builtin_function_or_method")),
    ("str inside a dict", lambda: sj(lambda p: p["w"], i=None, o=None)({"w": X, "name": "a"}), (TypeError, r"argument `p` \(args\[0\]\)\['name'\] is a str")),
    ("object dtype array", lambda: sj(i=None, o=None)(np.array([1, "a"], object)), (TypeError, NAMED + r" is a numpy array of dtype object \(object\).*Hint: pass numbers")),
    ("ragged nested list", lambda: sj(i=None, o=None)(np.array([[1], [1, 2]], object)), (TypeError, "ragged nested list becomes an object array")),
    ("str dtype array", lambda: sj(i=None, o=None)(np.array(["a", "b"])), (TypeError, NAMED + r" is a numpy array of dtype <U1 \(str\).*token ids")),
    ("bytes dtype array", lambda: sj(i=None, o=None)(np.array([b"a"])), (TypeError, r"dtype \|S1 \(bytes\)")),
    ("structured array", lambda: sj(i=None, o=None)(np.zeros(4, [("a", "f4"), ("b", "i4")])), (TypeError, r"\(structured\).*one array per field")),
    ("datetime array", lambda: sj(i=None, o=None)(np.zeros(2, "M8[s]")), (TypeError, r"\(datetime64\).*astype\(np.int64\)")),
    ("timedelta array", lambda: sj(i=None, o=None)(np.zeros(2, "m8[s]")), (TypeError, r"\(timedelta64\)")),
    ("python int too large", lambda: sj(lambda x, n: x * n, i=(P(2, 1), None))(X, 2 ** 40), (TypeError, r"argument `n` \(args\[1\]\) is the Python int 1099511627776, which does not fit in int32.*static_argnums")),
    ("python int too small", lambda: sj(lambda x, n: x * n, i=(P(2, 1), None))(X, -2 ** 40), (TypeError, r"Python int -1099511627776")),
    ("python int in range ok", lambda: float(sj(lambda x, n: x.sum() * n, i=(P(2, 1), None), o=None)(X, 2 ** 20)), OK(496.0 * 2 ** 20)),
    ("big-endian float32", lambda: np.asarray(sj()(X.astype(">f4"))).tolist(), OK(X.tolist())),
    ("big-endian int16", lambda: np.asarray(sj()(X.astype(">i2"))).tolist(), OK(X.astype(np.int16).tolist())),
    ("non-contiguous numpy", lambda: np.asarray(sj(i=P(2, 1))(np.asfortranarray(X))).tolist(), OK(X.tolist())),
    ("float64 becomes float32", lambda: sj()(X.astype(np.float64)).dtype, OK(np.float32)),
    ("bool input", lambda: bool(sj(o=None)(X > 3).all()), OK(False)),
    ("float16 input", lambda: sj()(X.astype(np.float16)).dtype, OK(np.float16)),
    ("bfloat16 input", lambda: sj()(X.astype(jnp.bfloat16)).dtype, OK(jnp.bfloat16)),
    ("complex input", lambda: sj()(X.astype(np.complex64)).dtype, OK(np.complex64)),
    ("numpy scalar", lambda: float(sj(i=None, o=None)(np.float32(2.5))), OK(2.5)),
    ("python float", lambda: float(sj(i=None, o=None)(2.5)), OK(2.5)),
    ("python bool", lambda: bool(sj(i=None, o=None)(True)), OK(True)),
    ("None argument is an empty tree", lambda: sj(lambda x: 1.0, i=None, o=None)(None), OK(1.0)),
    ("list of arrays", lambda: [a.shape for a in sj(i=None, o=None)([X, W])], OK([(8, 4), (4, 4)])),
    ("rank mismatch", lambda: sj(i=P(2, 1, 1))(X), (ValueError, NAMED + r" with shape \(8, 4\): spec PartitionSpec\(2, 1, 1\) has 3 entries but the array has rank 2")),
    ("scalar with a split spec", lambda: sj(i=P(2), o=None)(np.float32(1)), (ValueError, r"shape \(\): spec PartitionSpec\(2\).*For scalars the spec should be PartitionSpec\(\) or None")),
    ("scalar with P()", lambda: float(sj(i=P(), o=None)(np.float32(1))), OK(1.0)),
    ("not divisible", lambda: sj(i=P(3, 1), o=None)(X), (ValueError, NAMED + r".*size 8.*not divisible.*count 3.*Hint")),
    ("not divisible second dim", lambda: sj(i=P(1, 3), o=None)(X), (ValueError, r"dimension 1.*size 4.*count 3")),
    ("more tiles than devices", lambda: sj(i=P(16, 1), o=None)(np.ones((16, 2), np.float32)), (ValueError, "requires 16 devices, but only 8 devices are available.*xla_force_host_platform_device_count=16")),
    ("specs disagree", lambda: sj(lambda x, y: x.sum() + y.sum(), i=(P(2, 1), P(3, 1)), o=None)(X, X[:6]), (ValueError, r"argument `x` \(args\[0\]\): spec PartitionSpec\(2, 1\) partitions into 2 tiles, which do not divide the 3 partitions of sharded_jit function \S+ \(from in_parts for argument `y` \(args\[1\]\) = PartitionSpec\(3, 1\)\).*Hint")),
    ("smaller total is partially replicated", lambda: sj(lambda x, w: x @ w, i=(P(2, 1), P(4, 1)), o=None)(X, W).sharding.num_devices, OK(4)),
    ("num_partitions disagrees", lambda: sj(num_partitions=3)(X), (ValueError, r"partitions into 2 tiles, which do not divide the 3 partitions.*\(from num_partitions=3\)")),
    ("num_partitions larger replicates", lambda: len(sj(num_partitions=8)(X).addressable_shards), OK(8)),
    ("in_parts tree too long", lambda: sj(i=(P(2, 1), None))(X), (ValueError, r"in_parts does not match.*Hint")),
    ("in_parts dict key missing", lambda: sj(lambda p: p["a"], i=({"b": P(2, 1)},))({"a": X}), (ValueError, r"in_parts does not match")),
    ("out_parts tree too long", lambda: sj(o=(P(2, 1), P(2, 1)))(X), (ValueError, r"out_parts does not match.*Hint")),
    ("out_parts rank mismatch", lambda: sj(lambda x: x.sum(0))(X), (ValueError, r"out_parts for output with shape \(4,\).*rank 1")),
    ("static argument unhashable", lambda: sj(lambda x, s: x, static_argnums=1)(X, [1]), (TypeError, r"static argument `s` \(args\[1\]\) must be hashable, got list")),
    ("static_argnums out of range", lambda: sj(static_argnums=3)(X), (ValueError, r"static_argnums contains 3, but the function was called with 1 positional argument")),
    ("static_argnums negative out of range", lambda: sj(static_argnums=-3)(X), (ValueError, r"static_argnums contains -3")),
    ("donate_argnums out of range", lambda: sj(donate_argnums=3)(X), (ValueError, r"donate_argnums contains 3")),
    ("deleted input", lambda: sj()(_deleted()), (ValueError, NAMED + r" \(shape \(8, 4\)\) has been deleted.*donate_argnums")),
    ("donated input reused", lambda: _donate_twice(), (ValueError, NAMED + r" \(shape \(8, 4\)\) has been deleted: it was donated")),
    ("input on other devices ok", lambda: np.asarray(sj()(jax.device_put(X, D[5]))).tolist(), OK(X.tolist())),
    ("input with other tiling ok", lambda: np.asarray(sj()(sj(i=None, o=P(1, 2))(X))).tolist(), OK(X.tolist())),
    ("local_in_parts mismatch", lambda: sj(local_in_parts=P(3, 1))(X), (ValueError, r"local_in_parts for argument `x` \(args\[0\]\): spec PartitionSpec\(3, 1\) does not match in_parts")),
    ("local_num_partitions mismatch", lambda: sj(local_num_partitions=3)(X), (ValueError, r"local_num_partitions=3 over 1 processes makes 3 partitions, but the specs partition into 2")),
    # --- the function itself -------------------------------------------------------
    ("returns a str", lambda: sj(lambda x: "hi", o=None)(X), (TypeError, r"sharded_jit function <lambda> \(defined at .*test_bad_inputs.py:\d+\) returned a value of type str \('hi'\) at output \(the whole output\), not an array")),
    ("returns an object", lambda: sj(lambda x: object(), o=None)(X), (TypeError, r"returned a value of type object")),
    ("returns a str in a tuple", lambda: sj(lambda x: (x, "s"), o=None)(X), (TypeError, r"returned a value of type str \('s'\) at output\[1\]")),
    ("returns an object array", lambda: sj(lambda x: np.array([None]), o=None)(X), (TypeError, r"returned a value of type ndarray")),
    ("returns None", lambda: sj(lambda x: None, o=None)(X), OK(None)),
    ("returns a number", lambda: sj(lambda x: 3, o=None)(X), OK(3)),
    ("raises inside", lambda: sj(lambda x: 1 / 0)(X), (ZeroDivisionError, "division by zero")),
    ("ordered effects", lambda: sj(lambda x: jax.debug.print("{}", x, ordered=True) or x)(X), (NotImplementedError, "ordered side effects.*ordered=True")),
    ("nested with another count", lambda: sj(lambda x: sj(i=P(3, 1), o=None)(x[:6]).sum(), o=None)(X), (ValueError, r"spec PartitionSpec\(2, 1\) partitions into 2 tiles, which do not divide the 3 partitions .*\(from with_sharding_constraint at .*test_bad_inputs.py:\d+ \(<lambda>\), in_parts for argument `x` \(args\[0\]\) of the nested sharded_jit function <lambda> = PartitionSpec\(3, 1\)\)")),
    ("nested with the same count ok", lambda: np.asarray(sj(lambda x: sj(lambda y: y * 2)(x))(X)).sum(), OK(992.0)),
    # --- with_sharding_constraint ----------------------------------------------------
    ("constraint rank", lambda: sj(lambda x: wsc(x, P(2)))(X), (ValueError, r"with_sharding_constraint\(x\) at .*test_bad_inputs.py:\d+ \(<lambda>\): spec PartitionSpec\(2\) has 1 entries but the array has rank 2")),
    ("constraint not divisible is exact", lambda: np.asarray(sj(lambda x: wsc(x[:7] * 2, P(2, 1)).sum(0), o=None)(X)).tolist(), OK((X[:7] * 2).sum(0).tolist())),
    ("constraint spec str", lambda: sj(lambda x: wsc(x, "2"))(X), (TypeError, r"with_sharding_constraint spec: expected a sharding.PartitionSpec or None, got '2'")),
    ("constraint on a str", lambda: sj(lambda x: wsc("s", P(2)) and x)(X), (TypeError, r"with_sharding_constraint\(x\) at .*: expected an array, got a value of type str")),
    ("constraint other count", lambda: sj(lambda x: wsc(x[:6], P(3, 1)).sum(), o=None)(X), (ValueError, r"spec PartitionSpec\(2, 1\) partitions into 2 tiles, which do not divide the 3 partitions .*\(from with_sharding_constraint at .*test_bad_inputs.py:\d+ \(<lambda>\) = PartitionSpec\(3, 1\)\)")),
    ("constraint tree mismatch", lambda: sj(lambda x: wsc((x, x), (P(2, 1),))[0])(X), (ValueError, "with_sharding_constraint spec does not match")),
    ("constraint outside is identity", lambda: np.asarray(wsc(X, P(2, 1))).tolist(), OK(X.tolist())),
    # --- lower / compile / explain -----------------------------------------------------
    ("compiled with another shape", lambda: sj().lower(X).compile()(W), (TypeError, r"was lowered for arguments \[float32\[8, 4\]\].*called with \[float32\[4, 4\]\].*Hint")),
    ("compiled with another dtype", lambda: sj().lower(X).compile()(X.astype(np.int32)), (TypeError, r"called with \[int32\[8, 4\]\]")),
    ("compiled with more arguments", lambda: sj().lower(X).compile()(X, X), (TypeError, r"was lowered for arguments")),
    ("lower with keywords", lambda: sj().lower(x=X), (TypeError, "keyword arguments")),
    ("lower with a ShapeDtypeStruct ok", lambda: sj().lower(jax.ShapeDtypeStruct((8, 4), jnp.float32)).num_partitions, OK(2)),
    ("call with a ShapeDtypeStruct", lambda: sj()(jax.ShapeDtypeStruct((8, 4), jnp.float32)), (TypeError, NAMED + r" is a jax.ShapeDtypeStruct \(float32\[8, 4\]\), which describes an array but holds no data. Hint: pass an array.*\.lower")),
    ("in_parts dict for a leaf", lambda: sj(i=({"w": P(2, 1)},))(X), (ValueError, r"in_parts does not match the structure it describes at in_parts\[0\]: in_parts has a dict with keys \['w'\] but the values have float32\[8, 4\]")),
    ("explain a plain function", lambda: explain(lambda x: x, X), (TypeError, "explain")),
    # --- settings -----------------------------------------------------------------------
    ("partitioner unknown", lambda: setting(partitioner="xla"), (ValueError, r"config.partitioner must be one of \('shardy', 'gspmd'\), got 'xla'.*SHARDED_JIT_PARTITIONER")),
    ("cache_dir number", lambda: setting(cache_dir=5), (ValueError, r"config.cache_dir must be a directory path.*got 5")),
    ("cache_max_bytes negative", lambda: setting(cache_max_bytes=-1), (ValueError, r"cache_max_bytes must be a whole number >= 0, got -1")),
    ("cache_max_bytes inf", lambda: setting(cache_max_bytes=math.inf), (ValueError, r"cache_max_bytes must be a whole number >= 0, got inf")),
    ("cache_max_bytes fraction", lambda: setting(cache_max_bytes=1.5), (ValueError, r"got 1.5")),
    ("cache_min_compile_secs nan", lambda: setting(cache_min_compile_secs=math.nan), (ValueError, r"cache_min_compile_secs must be a number of seconds >= 0, got nan")),
    ("cache_min_entry_bytes str", lambda: setting(cache_min_entry_bytes="10"), (ValueError, r"cache_min_entry_bytes must be a whole number >= 0, got '10'")),
    ("cache_store without put", lambda: setting(cache_store={}), (TypeError, r"cache_store needs get\(key\) and put\(key, data\) methods")),
    ("log_compiles str", lambda: setting(log_compiles="yes"), (ValueError, r"config.log_compiles must be True or False, got 'yes'")),
    ("xla_options str", lambda: setting(xla_options="a=1"), (ValueError, r"xla_options must be a dict of XLA option names to values")),
    ("heartbeat zero", lambda: setting(heartbeat_timeout_secs=0), (ValueError, r"heartbeat_timeout_secs must be a whole number >= 2, got 0.*shorter ends healthy jobs")),
    ("heartbeat inf", lambda: setting(heartbeat_timeout_secs=math.inf), (ValueError, r"heartbeat_timeout_secs must be a whole number >= 2, got inf")),
    ("collective timeout zero", lambda: setting(collective_timeout_secs=0), (ValueError, r"collective_timeout_secs must be a number of seconds > 0 \(inf: no limit\), got 0")),
    ("collective timeout nan", lambda: setting(collective_timeout_secs=math.nan), (ValueError, r"got nan")),
    ("collective timeout negative", lambda: setting(collective_timeout_secs=-5), (ValueError, r"got -5")),
    ("collective timeout inf ok", lambda: setting(collective_timeout_secs=math.inf), OK(None)),
    ("max_inflight_steps negative", lambda: setting(max_inflight_steps=-1), (ValueError, r"max_inflight_steps must be a whole number >= 0, got -1")),
    ("max_inflight_steps fraction", lambda: setting(max_inflight_steps=1.5), (ValueError, r"got 1.5")),
    ("unknown setting", lambda: setting(cache_directory="/tmp"), (AttributeError, r"unknown setting 'cache_directory'; settings: \[")),
    ("override unknown setting", lambda: config.override(nope=1).__enter__(), (AttributeError, r"unknown setting 'nope'")),
    ("env partitioner", lambda: env(partitioner="xla"), (ValueError, r"environment variable SHARDED_JIT_PARTITIONER='xla': must be one of")),
    ("env collective timeout zero", lambda: env(collective_timeout_secs="0"), (ValueError, r"SHARDED_JIT_COLLECTIVE_TIMEOUT_SECS='0': must be a number of seconds > 0.*Hint")),
    ("env collective timeout text", lambda: env(collective_timeout_secs="soon"), (ValueError, r"SHARDED_JIT_COLLECTIVE_TIMEOUT_SECS='soon': could not convert")),
    ("env collective timeout inf ok", lambda: env(collective_timeout_secs="inf").collective_timeout_secs, OK(math.inf)),
    ("env heartbeat zero", lambda: env(heartbeat_timeout_secs="0"), (ValueError, r"SHARDED_JIT_HEARTBEAT_TIMEOUT_SECS='0': must be a whole number >= 2")),
    ("env max bytes text", lambda: env(cache_max_bytes="2GB"), (ValueError, r"SHARDED_JIT_CACHE_MAX_BYTES='2GB'")),
    ("env inflight fraction", lambda: env(max_inflight_steps="1.5"), (ValueError, r"SHARDED_JIT_MAX_INFLIGHT_STEPS='1.5'")),
    ("env log_compiles", lambda: env(log_compiles="maybe"), (ValueError, r"SHARDED_JIT_LOG_COMPILES='maybe': expected a boolean")),
    ("env xla options", lambda: env(xla_options="novalue"), (ValueError, r"expected name=value pairs")),
    ("env cache_dir tilde", lambda: env(cache_dir="~/c").cache_dir, OK(os.path.expanduser("~/c"))),
    # --- sharding helpers -----------------------------------------------------------------
    ("tiling too few devices", lambda: tiling(P(4, 1), D[:2], 2), (ValueError, r"4")),
    ("local_spec not shareable", lambda: local_spec(P(3, 1), 2, "w"), (ValueError, r"w: spec PartitionSpec\(3, 1\) has 3 tiles, which cannot be shared equally by 2 processes")),
    ("local_spec not rectangular", lambda: local_spec(P(3, 2), 2, "w"), (ValueError, r"does not give each process a rectangular piece.*Hint.*PartitionSpec\(6, 1\)")),
    ("local_spec ok", lambda: local_spec(P(4, 2), 2, "w"), OK(P(2, 2))),
    ("global_shape ok", lambda: global_shape((4, 4), P(2, 1), P(1, 1)), OK((8, 4))),
    ("local_shape ok", lambda: local_shape((8, 4), P(2, 1), P(1, 1)), OK((4, 4))),
]


def _deleted():
  a = jnp.array(X)
  a.delete()
  return a


def _donate_twice():
  f = sj(donate_argnums=0)
  a = f(X)
  f(a)
  return f(a)


@pytest.mark.parametrize("what,call,expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input(what, call, expected):
  if isinstance(expected, OK):
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # a right answer comes without warnings
      got = call()
    assert got == expected.value, (what, got)
    return
  kind, pattern = expected
  with pytest.raises(kind) as info:
    call()
  message = str(info.value)
  assert re.search(pattern, message, re.S), f"{what}: {type(info.value).__name__}: {message}"
  assert "This is a bug in sharded_jit" not in message
  assert "dtype_to_ir_type" not in message and "_trace.py" not in message


def test_each_case_has_a_name_of_its_own():
  # (pytest ids them by name: two alike would run under one id, the second
  # hiding the first's failure)
  names = [c[0] for c in CASES]
  assert sorted(n for n in set(names) if names.count(n) > 1) == []


@pytest.fixture(autouse=True)
def _restore_config():
  saved = dict(config.__dict__)
  yield
  for name, value in saved.items():
    object.__setattr__(config, name, value)


def test_int64_values_that_wrap_warn_and_name_the_argument():
  with pytest.warns(UserWarning, match=NAMED + r" is int64 with values up to 1099511627776,"
                    r" outside int32's range.*jax_enable_x64"):
    sj(i=None, o=None)(np.array([1, 2 ** 40]))


SIX, EMPTY = np.ones((6, 4), np.float32), np.ones((0, 4), np.float32)
TOO_FEW = r"requires {} devices.*, but only 8 devices are available"
HUGE = [  # each fails at once, building nothing per tile (test_partition_spec.py: the hint)
    ("in_parts 10**9", lambda: sj(i=P(10**9, 1), o=None)(SIX), NAMED + r".*not divisible by its partition count 1000000000"),
    ("in_parts 2**63", lambda: sj(i=P(2**63), o=None)(np.ones(6, np.float32)), NAMED + r".*count 9223372036854775808"),
    ("out_parts 2**40", lambda: sj(i=None, o=P(2**40, 1))(SIX), r"out_parts.*count 1099511627776"),
    ("in_parts 10**9 zero-size", lambda: sj(i=P(10**9, 1), o=None)(EMPTY), TOO_FEW.format(10**9)),
    ("in_parts 2**63 zero-size", lambda: sj(i=P(2**63, 1), o=None)(EMPTY), TOO_FEW.format(2**63)),
    ("constraint 2**63", lambda: sj(lambda x: wsc(x, P(2**63, 1)), i=None, o=None)(SIX), TOO_FEW.format(2**63)),
    ("num_partitions 10**9", lambda: sj(i=None, o=None, num_partitions=10**9)(SIX), TOO_FEW.format(10**9)),
    ("pmap constraint 10**9", lambda: pmap(lambda x: wsc(x, P(10**9, 1)))(SIX[None]), TOO_FEW.format(10**9)),
    ("tiling 2**63", lambda: tiling(P(2**63), D, 1), r"PartitionSpec\(9223372036854775808\) partitions into 9223372036854775808 tiles"),
]


@pytest.mark.parametrize("what,call,pattern", HUGE, ids=[c[0] for c in HUGE])
def test_huge_partition_counts_fail_fast(what, call, pattern):
  raised = []
  worker = threading.Thread(target=lambda: raised.append(pytest.raises(ValueError, call)),
                            daemon=True)  # a hang fails this test, not the run
  worker.start()
  worker.join(timeout=10)
  assert not worker.is_alive() and raised, f"{what}: no ValueError within 10 s"
  assert re.search(pattern, str(raised[0].value), re.S), f"{what}: {raised[0].value}"


def test_numpy_inputs_changed_right_after_the_call_do_not_change_the_result():
  f = sj(lambda x: x * 2)
  for _ in range(30):
    x = np.full((8, 4), 1.0, np.float32)
    out = f(x)
    x[:] = 100.0  # the caller reuses its buffer at once
    assert np.asarray(out).max() == 2.0
