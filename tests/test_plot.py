"""Training-curve plots: one curve per run across resumed sessions, PNG output, bad files."""

import json

import pytest

from transformer_jax import plot


def _write(workdir, records):
  workdir.mkdir(parents=True, exist_ok=True)
  (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# Session 1 logs steps 50 and 100 and evaluates at 100, then is interrupted; session 2 resumes
# from the checkpoint at step 50 and redoes step 100 (other values) before going on to 150.
RESUMED = [
    {"step": 0, "kind": "start", "resumed": False},
    {"step": 50, "kind": "train", "nll": 5.0, "learning_rate": 1e-3, "elapsed_s": 60.0},
    {"step": 100, "kind": "train", "nll": 4.0, "learning_rate": 2e-3, "elapsed_s": 120.0},
    {
        "step": 100,
        "kind": "eval",
        "perplexity": 50.0,
        "train_subset_perplexity": 40.0,
        "bleu": 10.0,
        "elapsed_s": 130.0,
    },
    {"step": 50, "kind": "start", "resumed": True},
    {"step": 100, "kind": "train", "nll": 3.9, "learning_rate": 2e-3, "elapsed_s": 30.0},
    {"step": 150, "kind": "train", "nll": 3.0, "learning_rate": 3e-3, "elapsed_s": 90.0},
    {"step": 150, "kind": "final", "test_bleu": 20.0},
]


def test_a_resumed_run_is_one_curve_with_the_redone_steps_and_summed_wall_time():
  by_step = plot.curves(RESUMED, "step")
  assert by_step["training NLL"] == ([50.0, 100.0, 150.0], [5.0, 3.9, 3.0])  # the redo wins
  assert by_step["validation perplexity"] == ([100.0], [50.0])
  assert by_step["training-pairs perplexity"] == ([100.0], [40.0])  # drawn dashed beside it
  assert by_step["validation BLEU (periodic subset)"] == ([100.0], [10.0])
  assert by_step["learning rate"][1] == [1e-3, 2e-3, 3e-3]
  by_time = plot.curves(RESUMED, "time")
  # Session 2's clock restarts at zero: its records come after session 1's 130 s.
  assert by_time["training NLL"][0] == pytest.approx([1.0, (130 + 30) / 60, (130 + 90) / 60])
  # Files written before "start" records existed: a clock that goes back marks the new session.
  legacy = [r for r in RESUMED if r["kind"] != "start"]
  assert plot.curves(legacy, "time")["training NLL"][0] == by_time["training NLL"][0]


def test_two_runs_are_drawn_into_one_png(tmp_path):
  pytest.importorskip("matplotlib")
  _write(tmp_path / "a", RESUMED)
  _write(tmp_path / "b", [dict(r, nll=r["nll"] + 1) if "nll" in r else r for r in RESUMED])
  runs = {name: plot.read_metrics(str(tmp_path / name)) for name in ("a", "b")}
  output = tmp_path / "curves.png"
  plot.plot(runs, str(output), x="time")
  assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  import matplotlib.image

  height, width, _ = matplotlib.image.imread(str(output)).shape
  assert (width, height) == (1100, 700)
  summary = plot.summary(str(tmp_path / "a"), runs["a"])
  assert summary["last_step"] == 150
  assert summary["training_minutes"] == pytest.approx(220 / 60, abs=0.05)


def test_a_damaged_metrics_file_names_the_line(tmp_path):
  _write(tmp_path, RESUMED[:2])
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 100, "kind": "tra\n')  # a line cut short
  with pytest.raises(ValueError, match=r"metrics.jsonl line 3 is not valid JSON \(column \d+: "):
    plot.read_metrics(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text('{"loss": 1.0}\n')
  with pytest.raises(ValueError, match=r"metrics.jsonl line 1 lacks \['step', 'kind'\]"):
    plot.read_metrics(str(tmp_path))
  (tmp_path / "metrics.jsonl").write_text("[1]\n")
  with pytest.raises(ValueError, match=r"line 1 holds a JSON array where a JSON object is"):
    plot.read_metrics(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="is .* the --workdir of a training run"):
    plot.read_metrics(str(tmp_path / "nothing"))


def test_a_last_record_cut_short_by_a_killed_run_is_left_out(tmp_path, caplog):
  # A run killed while writing a record leaves it without its line end: the curves up to it are
  # drawn, with a warning; training, when it resumes, drops it before appending (train.py).
  _write(tmp_path, RESUMED[:2])
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 100, "kind": "tra')
  assert plot.read_metrics(str(tmp_path)) == RESUMED[:2]
  assert "metrics.jsonl line 3 is cut short" in caplog.text
