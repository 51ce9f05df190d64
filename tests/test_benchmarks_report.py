"""BENCHMARKS.md's summary is what benchmarks/report.py renders from the
committed benchmarks/results.json, and stays a summary: at most 25 rows,
no cell over 150 characters, no date. Fast: nothing is run, jax is not
imported."""

import json
import os
import re

import pytest

from benchmarks import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b|this session|last session|\b(since|until) 20\d\d")


def _results() -> dict:
  with open(os.path.join(ROOT, "benchmarks", "results.json")) as f:
    return json.load(f)


def _benchmarks_md() -> str:
  with open(os.path.join(ROOT, "BENCHMARKS.md")) as f:
    return f.read()


def _summary_block(text: str) -> str:
  return text[text.index(report.SUMMARY_BEGIN):text.index(report.SUMMARY_END)
              + len(report.SUMMARY_END)]


def _table_rows(block: str) -> list[list[str]]:
  """The summary table's rows, header and separator left out, as cells."""
  lines = [line for line in block.splitlines() if line.startswith("|")]
  return [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines[2:]]


def test_the_generated_blocks_are_what_results_json_gives():
  text = _benchmarks_md()
  assert report.rendered(_results(), text) == text, (
      "BENCHMARKS.md is stale: python -m benchmarks.report rewrites it from results.json")
  assert _summary_block(text) == report.summary(_results(), report.images())


def test_the_summary_is_short_undated_and_near_the_top():
  text = _benchmarks_md()
  block = _summary_block(text)
  rows = _table_rows(block)
  assert 0 < len(rows) <= 25
  long = [c for row in rows for c in row if len(c) > 150]
  assert long == []
  assert [line for line in block.splitlines() if DATE.search(line)] == []
  assert all(len(row) == 4 for row in rows)
  # one figure or range a cell: no list of runs, no narrative in the figures
  figures = [row[1] for row in rows if not row[0].startswith("**")]
  assert all(re.fullmatch(r"[\d.]+(-[\d.]+)?(x| s)?", f) for f in figures), figures
  # a row per machine heads its group, and a plot comes before the method text
  assert [row[0] for row in rows if row[0].startswith("**")] == [
      f"**{t.format(**{k: _results()[k] for k in ('cores', 'devices', 'jax')})}**"
      for t in report.GROUPS.values()]
  assert "![" in block
  assert text.index(report.SUMMARY_BEGIN) < text.index("## Commands")
  # what doc-check reads as the summary: the first table of the file
  first = next(i for i, line in enumerate(text.splitlines()) if line.startswith("|"))
  assert text.splitlines()[first] == "| headline | ours / reference: range over runs | reference" \
                                     " | command |"


def test_every_headline_reads_rows_the_committed_results_hold():
  # a renamed case or section would leave a figure to its old runs alone
  results = _results()
  for h in report.HEADLINES:
    for figure in (h.figure, *h.asides):
      for rows in figure.rows:
        assert rows.section in report.SECTIONS
        assert report._values(results.get(rows.section) or [], rows), (figure.key, rows)
      assert figure.key in results["summary_runs"]
  keys = [f.key for h in report.HEADLINES for f in (h.figure, *h.asides)]
  assert len(keys) == len(set(keys))


def _row(case: str, ratio: float, **more) -> dict:
  return {"case": case, "unit": "us", "ours": ratio, "jax": 1.0, "ratio": ratio, **more}


def test_a_merge_keeps_each_figures_last_runs(tmp_path):
  path = tmp_path / "results.json"
  figure = "dispatch: per-call, 8 devices"
  path.write_text(json.dumps({"summary_runs": {figure: {"earlier": [0.5, 2.0]}}}))
  for i in range(report.RUNS_KEPT + 2):
    merged = report.merge({"dispatch": [_row("per-call, sharded_jit, 8 device(s)", 1 + i / 100),
                                        _row("per-call, pmap, 8 device(s)", 1.0),
                                        _row("per-call, sharded_jit, 1 device(s)", 9.0)]},
                          "python -m benchmarks --full --only dispatch", str(path))
    kept = merged["summary_runs"][figure]
    if i == 0:  # the range recorded of earlier runs stays until RUNS_KEPT are kept
      assert kept == {"earlier": [0.5, 2.0], "runs": {"dispatch": [[1.0, 1.0]]}}
      assert report._range(merged, report.HEADLINES[0].figure) == "0.50-2.00"
  assert kept["runs"]["dispatch"] == [[1.0, 1 + i / 100] for i in range(2, report.RUNS_KEPT + 2)]
  assert "earlier" not in kept
  assert report._range(merged, report.HEADLINES[0].figure) == "1.00-1.11"
  assert json.loads(path.read_text()) == merged
  assert merged["commits"]["dispatch"] == report._commit()


@pytest.mark.parametrize("command", [
    "python -m benchmarks --only dispatch",  # the default's size: a --full figure keeps its runs
    "python -m benchmarks --full --only dispatch --accelerator --devices 1",
    "python -m benchmarks --full --only dispatch --devices 4",
])
def test_a_run_of_another_size_or_machine_adds_no_run(tmp_path, command):
  path = tmp_path / "results.json"
  merged = report.merge({"dispatch": [_row("per-call, sharded_jit, 8 device(s)", 3.0)]},
                        command, str(path))
  assert merged["summary_runs"] == {}
  assert merged["dispatch"][0]["ratio"] == 3.0  # (its tables still show it)


def test_a_figure_of_two_sections_keeps_each_sections_runs(tmp_path):
  # the pipeline's steps/s: the pipeline section at --full, pipeline x data at any size
  path = tmp_path / "results.json"
  steps = next(h.figure for h in report.HEADLINES if h.figure.key == "pipeline: steps/s")
  report.merge({"pipeline": [_row("2 stages, 4 microbatches: steps/s", 0.9)]},
               "python -m benchmarks --full --only pipeline", str(path))
  merged = report.merge({"pipeline_data": [_row("2 stages x 4 data, 4 microbatches: steps/s",
                                                1.2)]},
                        "python -m benchmarks --only pipeline_data", str(path))
  assert merged["summary_runs"][steps.key]["runs"] == {"pipeline": [[0.9, 0.9]],
                                                       "pipeline_data": [[1.2, 1.2]]}
  assert report._range(merged, steps) == "0.90-1.20"


def test_an_estimate_shows_its_last_run_alone(tmp_path):
  path = tmp_path / "results.json"
  headline = next(h for h in report.HEADLINES if h.figure.key == "tpu_models: estimate")
  for least, most in ((0.5, 9.0), (0.8, 6.0)):
    merged = report.merge({"tpu_models": [
        _row("m, 8 v5p chips (compile-only): our estimate / XLA:TPU's, least over", least),
        _row("m, 8 v5p chips (compile-only): our estimate / XLA:TPU's, most over", most)]},
        "python -m benchmarks --only tpu_models", str(path))
  assert report._range(merged, headline.figure) == "0.80-6.00x"


def test_a_default_run_replaces_the_cases_it_gave_and_keeps_the_others(tmp_path):
  """A run without --full measures fewer cases: the others keep their last
  figures, in their places, and the section's command says which rows
  came from which command: a model none of whose rows the run gave by its
  name, the others by case (a name with a comma quoted; one with "; the "
  read back whole too)."""
  path = tmp_path / "results.json"
  full, default = "python -m benchmarks --full --only search", "python -m benchmarks --only search"
  a1, a2 = "MLP wide, batch 16: flops per device", "MLP wide, batch 16: search time (cold)"
  b1, b2 = "big, batch 8: flops per device", "big, batch 8: worst of the models; the search times"
  c1, new = "MLP narrow, batch 4096: flops per device", "MLP narrow, batch 4096: a new row"
  path.write_text(json.dumps({"search": [_row(c, 1.0) for c in (a1, a2, b1, b2, c1)],
                              "commands": {"search": full}}))
  merged = report.merge({"search": [_row(a2, 2.0), _row(a1, 2.0), _row(c1, 2.0),
                                    _row(new, 2.0)]}, default, str(path))
  # the run's rows in its order, in the places of those they replace; a new case after them
  assert [(r["case"], r["ratio"]) for r in merged["search"]] == [
      (a2, 2.0), (a1, 2.0), (b1, 1.0), (b2, 1.0), (c1, 2.0), (new, 2.0)]
  assert merged["commands"]["search"] == f'{default} (the "big, batch 8" rows: {full})'
  assert json.loads(path.read_text()) == merged
  # a second default run under another command: each kept row's own command stays said
  bench = "scripts/bench --only search"
  again = report.merge({"search": [_row(a1, 3.0), _row(c1, 3.0)]}, bench, str(path))
  assert [(r["case"], r["ratio"]) for r in again["search"]] == [
      (a2, 2.0), (a1, 3.0), (b1, 1.0), (b2, 1.0), (c1, 3.0), (new, 2.0)]
  assert again["commands"]["search"] == (
      f'{bench} (the "{a2}", "{new}" rows: {default}; the "big, batch 8" rows: {full})')
  # the same run once more: the same command (no row it gave is said kept)
  assert report.merge({"search": [_row(a1, 3.0), _row(c1, 3.0)]}, bench,
                      str(path))["commands"] == again["commands"]
  # a run that gives one of a model's rows: the model's others are said by case
  third = report.merge({"search": [_row(a1, 4.0), _row(b1, 4.0), _row(c1, 4.0)]}, bench,
                       str(path))
  assert third["commands"]["search"] == (
      f'{bench} (the "{a2}", "{new}" rows: {default}; the "{b2}" rows: {full})')
  # a name is looked up whole: "big, batch 8" is not the listed "big, batch 8, remat"
  assert report._with_kept(bench, [b2], f'{default} (the "big, batch 8, remat" rows: {full})',
                           [a1]) == f'{bench} (the "big, batch 8" rows: {default})'


def test_a_full_run_replaces_each_section_whole(tmp_path):
  # (a case renamed or dropped from --full does not linger beside its successor)
  path = tmp_path / "results.json"
  path.write_text(json.dumps({"search": [_row("m: old name", 1.0), _row("m: kept", 1.0)],
                              "commands": {"search": "python -m benchmarks --only search"}}))
  merged = report.merge({"search": [_row("m: new name", 2.0), _row("m: kept", 2.0)]},
                        "python -m benchmarks --full --only search", str(path))
  assert [(r["case"], r["ratio"]) for r in merged["search"]] == [("m: new name", 2.0),
                                                                 ("m: kept", 2.0)]
  assert merged["commands"]["search"] == "python -m benchmarks --full --only search"


def test_an_estimate_reads_the_cases_a_default_run_kept(tmp_path):
  """A default run of plan_real gives torchtitan's account, not the XLA:TPU
  rows (--full and libtpu): the estimate's last run still spans both."""
  path = tmp_path / "results.json"
  figure = next(h.figure for h in report.HEADLINES if h.figure.key == "plan_real: counted memory")
  titan = "Llama 3.1 8B, FSDP 8 on 8 x H100: counted peak vs torchtitan's published"
  tpu = _row("small decoder, 8 v5p chips: FSDP 8: counted vs XLA:TPU", 1.7,
             against="XLA:TPU's memory analysis")
  report.merge({"plan_real": [_row(titan, 0.8), tpu]},
               "python -m benchmarks --full --only plan_real", str(path))
  merged = report.merge({"plan_real": [_row(titan, 0.9)]}, "python -m benchmarks --only plan_real",
                        str(path))
  assert merged["summary_runs"][figure.key]["runs"]["plan_real"][-1] == [0.9, 1.7]
  assert report._range(merged, figure) == "0.90-1.70"


def test_a_measurement_reads_only_the_rows_the_run_gave(tmp_path):
  # (a kept row is an earlier run's figure: counted again, it would stand for this run)
  path = tmp_path / "results.json"
  figure = next(h.figure for h in report.HEADLINES if h.figure.key == "checkpoint: steps/s")
  every = lambda k: f"MLP on 8 devices: steps/s, saving every {k} steps, finish_within=1 (a crash"
  report.merge({"checkpoint": [_row(every(5), 0.9), _row(every(50), 0.5)]},
               "python -m benchmarks --only checkpoint", str(path))
  merged = report.merge({"checkpoint": [_row(every(5), 0.95)]},
                        "python -m benchmarks --only checkpoint", str(path))
  assert [r["ratio"] for r in merged["checkpoint"]] == [0.95, 0.5]
  assert merged["summary_runs"][figure.key]["runs"]["checkpoint"] == [[0.5, 0.9], [0.95, 0.95]]


def test_report_check_says_whether_benchmarks_md_is_stale(capsys):
  assert report.main(["--check"]) == 0
  assert "is what benchmarks/results.json gives" in capsys.readouterr().out
