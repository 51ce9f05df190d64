import pytest

from partitioner._compile.cache import entry as ce

# zstd where the zstandard package is installed (the test extra has it)
COMPRESSIONS = ["zlib", pytest.param("zstd", marks=pytest.mark.skipif(
    ce.default_compression() != "zstd", reason="zstandard is not installed"))]
ENTRY = ce.Entry(b"executable bytes " * 100, 1.25)
KEY = "ab" * 32


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_round_trip(compression):
  data = ce.encode(ENTRY, KEY, compression)
  assert data[:4] == b"SJIT"
  assert ce.decode(data, KEY) == ENTRY
  assert len(data) < len(ENTRY.executable)  # compressed


def test_default_compression_is_zstd_when_installed():
  pytest.importorskip("zstandard")
  assert ce.default_compression() == "zstd"


@pytest.mark.parametrize("damage,match", [
    (lambda d: d[:10], "shorter than its header"),
    (lambda d: d[:-5], "header says"),
    (lambda d: b"XXXX" + d[4:], "magic"),
    (lambda d: d[:60] + bytes([d[60] ^ 0xFF]) + d[61:], "checksum"),
    (lambda d: b"garbage" * 10, "magic|header"),
    (lambda d: b"", "shorter"),
])
@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_damaged_entries_raise_corrupt_entry(damage, match, compression):
  with pytest.raises(ce.CorruptEntry, match=match):
    ce.decode(damage(ce.encode(ENTRY, KEY, compression)), KEY)


def test_entry_of_another_key_is_rejected():
  with pytest.raises(ce.CorruptEntry, match="written for key"):
    ce.decode(ce.encode(ENTRY, KEY, "zlib"), "cd" * 32)


def test_unknown_compression():
  with pytest.raises(ValueError, match="unknown compression"):
    ce.encode(ENTRY, KEY, "lz4")
