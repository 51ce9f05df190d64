import os
import subprocess
import sys

import pytest

from partitioner import Config, config


def test_defaults():
  c = Config(environ={})
  assert c.partitioner == "shardy" and c.cache_dir is None
  assert c.cache_max_bytes == 2 ** 31 and c.cache_min_compile_secs == 0.0
  assert c.cache_min_entry_bytes == 0 and c.cache_store is None
  assert not c.log_compiles and not c.disable_most_optimizations
  assert c.xla_options == {}


def test_environment_variables():
  c = Config(environ={
      "SHARDED_JIT_PARTITIONER": "gspmd",
      "SHARDED_JIT_CACHE_DIR": "/tmp/x",
      "SHARDED_JIT_CACHE_MAX_BYTES": "1000",
      "SHARDED_JIT_CACHE_MIN_COMPILE_SECS": "0.5",
      "SHARDED_JIT_CACHE_MIN_ENTRY_BYTES": "10",
      "SHARDED_JIT_LOG_COMPILES": "true",
      "SHARDED_JIT_DISABLE_MOST_OPTIMIZATIONS": "1",
      "SHARDED_JIT_XLA_OPTIONS": "xla_cpu_enable_fast_math=false, xla_foo=3",
  })
  assert (c.partitioner, c.cache_dir, c.cache_max_bytes) == ("gspmd", "/tmp/x", 1000)
  assert (c.cache_min_compile_secs, c.cache_min_entry_bytes) == (0.5, 10)
  assert c.log_compiles and c.disable_most_optimizations
  assert c.xla_options == {"xla_cpu_enable_fast_math": "false", "xla_foo": "3"}


@pytest.mark.parametrize("env,match", [
    ({"SHARDED_JIT_CACHE_MAX_BYTES": "lots"}, "SHARDED_JIT_CACHE_MAX_BYTES='lots'"),
    ({"SHARDED_JIT_LOG_COMPILES": "maybe"}, "boolean"),
    ({"SHARDED_JIT_XLA_OPTIONS": "novalue"}, "name=value"),
    ({"SHARDED_JIT_CACHE_MIN_COMPILE_SECS": "-1"}, "seconds >= 0"),
])
def test_bad_environment_values(env, match):
  with pytest.raises(ValueError, match=match):
    Config(environ=env)


def test_setting_in_code_validates_and_names_the_env_variable():
  c = Config(environ={})
  with pytest.raises(ValueError, match=r"config.cache_max_bytes must be a whole number >= 0, got -5.*SHARDED_JIT_CACHE_MAX_BYTES"):
    c.cache_max_bytes = -5
  with pytest.raises(AttributeError, match="unknown setting 'cache_size'"):
    c.cache_size = 5
  with pytest.raises(TypeError, match="get\\(key\\) and put"):
    c.cache_store = object()
  with pytest.raises(ValueError, match=r"config.cache_dir must be a directory path.*got 5"):
    c.cache_dir = 5


@pytest.mark.parametrize("name", ["SHARDED_JIT_CACHE_DIR", "SHARDED_JIT_SEARCH_CACHE_DIR"])
@pytest.mark.parametrize("text", ["off", "none", "0", "False"])
def test_both_cache_directories_are_off_by_the_same_words(monkeypatch, name, text):
  """``off`` turns either cache off; it never names a directory ./off."""
  monkeypatch.setenv(name, text)
  c = Config()
  assert (c.cache_dir if name == "SHARDED_JIT_CACHE_DIR" else c.search_cache_dir) is None


def test_cache_dir_expands_the_home_directory(monkeypatch):
  monkeypatch.setenv("HOME", "/home/someone")
  c = Config(environ={"SHARDED_JIT_CACHE_DIR": "~/.cache/sj"})
  assert c.cache_dir == "/home/someone/.cache/sj"
  c.cache_dir = "~/other"
  assert c.cache_dir == "/home/someone/other"


def test_override_restores_even_on_error():
  before = config.partitioner
  with pytest.raises(RuntimeError):
    with config.override(partitioner="gspmd", log_compiles=True):
      assert config.partitioner == "gspmd"
      raise RuntimeError
  assert config.partitioner == before and not config.log_compiles
  with pytest.raises(AttributeError):
    with config.override(nope=1):
      pass


@pytest.mark.slow
def test_partitioner_env_variable():
  code = ("import partitioner; print(partitioner.config.partitioner)")
  env = dict(os.environ, SHARDED_JIT_PARTITIONER="gspmd")
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout
  assert out.strip() == "gspmd"
  env["SHARDED_JIT_PARTITIONER"] = "bogus"
  err = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True).stderr
  assert "SHARDED_JIT_PARTITIONER='bogus': must be one of ('shardy', 'gspmd')" in err


def test_config_rejects_bad_mode():
  with pytest.raises(ValueError, match="shardy"):
    config.partitioner = "auto"
