"""White-box: explain()'s parser of XLA's partitioned HLO text."""

from partitioner._report import collect as _collect

_HLO = """\
HloModule m, num_partitions=4

ENTRY %main {
  %p = f32[8,8]{1,0} parameter(0)
  %ar = f32[8,8]{1,0} all-reduce(%p), channel_id=1, metadata={op_name="jit(f)/add" stack_frame_id=2}
  %ags = (f32[2,8]{1,0}, f32[8,8]{1,0}) all-gather-start(%p), metadata={op_name="jit(f)/g"}
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  ROOT %a2a = (bf16[2,2]{1,0}, bf16[2,2]{1,0}) all-to-all(%p, %p), metadata={op_name="x" source_file="/a.py" source_line=7}
}

FileNames
1 "/src/model.py"

FunctionNames
1 "layer"

FileLocations
1 {file_name_id=1 function_name_id=1 line=42 end_line=42 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=1 parent_frame_id=1}
"""


def test_collectives_parser():
  ops = _collect.collectives(_HLO)
  assert [(o.kind, o.bytes) for o in ops] == [
      ("all-reduce", 256), ("all-gather", 256), ("all-to-all", 16)]
  assert ops[0].source == "/src/model.py:42 (layer)" and ops[0].op_name == "jit(f)/add"
  assert ops[1].source == ""
  assert ops[2].source == "/a.py:7"


# XLA's table as jaxlib prints it: each parent_frame_id one too high (frame
# 1, the outermost, shows parent_frame_id=1). The all-reduce was made in
# flax's Linear.__call__, called from the user's model.py:7 (forward).
_FLAX_HLO = """\
HloModule m, num_partitions=4

ENTRY %main {
  %p = f32[8,8]{1,0} parameter(0)
  ROOT %ar = f32[8,8]{1,0} all-reduce(%p), channel_id=1, metadata={op_name="jit(f)/dot_general" stack_frame_id=4}
}

FileNames
1 "/home/me/train.py"
2 "/home/me/model.py"
3 "/venv/lib/python3.11/site-packages/flax/nnx/nn/linear.py"
4 "/venv/lib/python3.11/site-packages/optax/_src/base.py"

FunctionNames
1 "<module>"
2 "forward"
3 "Linear.__call__"
4 "update"

FileLocations
1 {file_name_id=1 function_name_id=1 line=30 end_line=30 column=1 end_column=1}
2 {file_name_id=2 function_name_id=2 line=7 end_line=7 column=1 end_column=1}
3 {file_name_id=4 function_name_id=4 line=5 end_line=5 column=1 end_column=1}
4 {file_name_id=3 function_name_id=3 line=422 end_line=422 column=1 end_column=1}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=2}
3 {file_location_id=3 parent_frame_id=3}
4 {file_location_id=4 parent_frame_id=4}
"""


def test_source_is_the_first_frame_in_user_code():
  (op,) = _collect.collectives(_FLAX_HLO)
  # 4 (flax) -> 3 (optax) -> 2 (model.py: the user's) -> 1
  assert op.source == "/home/me/model.py:7 (forward)"
  assert op.via == "/venv/lib/python3.11/site-packages/flax/nnx/nn/linear.py:422 (Linear.__call__)"
  assert str(op).endswith("at /home/me/model.py:7 (forward) via flax/nnx/nn/linear.py:422"
                          " (Linear.__call__)")


def test_a_table_with_correct_parent_ids_is_read_as_written():
  fixed = _FLAX_HLO.replace("1 {file_location_id=1 parent_frame_id=1}",
                            "1 {file_location_id=1 parent_frame_id=0}")
  for k in (2, 3, 4):
    fixed = fixed.replace(f"{k} {{file_location_id={k} parent_frame_id={k}}}",
                          f"{k} {{file_location_id={k} parent_frame_id={k - 1}}}")
  (op,) = _collect.collectives(fixed)
  assert op.source == "/home/me/model.py:7 (forward)"


def test_only_library_frames_give_the_innermost():
  hlo = _FLAX_HLO.replace('"/home/me/model.py"', '"/venv/lib/python3.11/site-packages/jax/x.py"')
  hlo = hlo.replace('"/home/me/train.py"', '"/venv/lib/python3.11/site-packages/orbax/y.py"')
  (op,) = _collect.collectives(hlo)
  assert op.source.endswith("flax/nnx/nn/linear.py:422 (Linear.__call__)") and op.via == ""
