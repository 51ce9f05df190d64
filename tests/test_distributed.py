import pytest

from partitioner import _distributed, initialize


@pytest.mark.parametrize("env,want", [
    ({}, (0, 1)),
    ({"PMI_RANK": "1", "PMI_SIZE": "4"}, (1, 4)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3"}, (2, 3)),
    ({"PMI_RANK": "x", "PMI_SIZE": "4"}, (0, 1)),
])
def test_launcher_world(monkeypatch, env, want):
  for var in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
              "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "PMIX_RANK", "PMIX_SIZE"):
    monkeypatch.delenv(var, raising=False)
  for k, v in env.items():
    monkeypatch.setenv(k, v)
  assert _distributed.launcher_world() == want


def test_initialize_outside_mpi_is_a_single_process_no_op():
  world = initialize()
  assert (world.rank, world.size, world.multi) == (0, 1, False)
  assert initialize() is world  # idempotent
