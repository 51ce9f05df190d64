"""White-box: explain()'s parser of XLA's partitioned HLO text."""

from partitioner import _explain

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
  ops = _explain.collectives(_HLO)
  assert [(o.kind, o.bytes) for o in ops] == [
      ("all-reduce", 256), ("all-gather", 256), ("all-to-all", 16)]
  assert ops[0].source == "/src/model.py:42 (layer)" and ops[0].op_name == "jit(f)/add"
  assert ops[1].source == ""
  assert ops[2].source == "/a.py:7"
