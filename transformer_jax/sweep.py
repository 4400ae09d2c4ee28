"""Runs the rows of a sweep config (e.g. Table 3) one after another and tabulates the results.

  python -m transformer_jax.sweep --config configs/table3.py --workdir_root DIR
      [--rows A1,A2] [--override train.num_steps=20000 ...] [--dry_run] [--table_only]

A sweep config is a config file whose `get_config(row)` takes a row name and whose module has a
`PAPER` dict: row -> (changes, paper's PPL, paper's BLEU, paper's parameters in millions or
None), as `configs/table3.py` has. Each row trains in its own process with
`python train.py --config CONFIG:ROW --workdir DIR/ROW` plus every `--override KEY=VALUE` as
`--config.KEY=VALUE`, so one row's failure or memory never reaches the next. A row whose workdir
has `results.json` is done and skipped; any other resumes from its last checkpoint, so rerunning
the same command after an interruption continues the sweep. A preempted row (exit status 143)
stops the sweep with the same status.

Every row's config, with the overrides, is built and validated before anything trains, so a typo
fails at once. At the end (and with --table_only, without training) `DIR/table.md` and
`DIR/table.json` compare each finished row with the paper: parameters, steps, the perplexity on
the eval split and the BLEU on the test split (for Table 3 both are newstest2013). One JSON line
with the table is printed.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
import os
import pathlib
import subprocess
import sys

from absl import flags
from etils import epath

from transformer_jax import cli, files
from transformer_jax import config as config_lib
from transformer_jax.errors import UserError

REPO = pathlib.Path(__file__).resolve().parents[1]
PREEMPTED = 143  # train.py's exit status after a SIGTERM (transformer_jax.training.preemption)


def _define_flags():
  flags.DEFINE_string("config", "configs/table3.py", "Sweep config file (with a PAPER dict).")
  flags.DEFINE_string("workdir_root", None, "Each row trains in WORKDIR_ROOT/ROW.")
  flags.DEFINE_list("rows", [], "Rows to run, comma-separated; default: every row in PAPER.")
  flags.DEFINE_multi_string(
      "override", [], "KEY=VALUE applied to every row (as --config.KEY=VALUE); repeatable."
  )
  flags.DEFINE_bool("dry_run", False, "Print each row's command and stop.")
  flags.DEFINE_bool("table_only", False, "Only write the table from the finished rows.")


def load_sweep(path: str):
  """The sweep config module (`get_config`, `PAPER`), loaded from its file."""
  if not os.path.isfile(path):
    raise UserError(f"--config={path}: no such sweep config file (from {os.getcwd()})")
  if str(REPO) not in sys.path:  # configs import each other as `configs.*`
    sys.path.insert(0, str(REPO))
  spec = importlib.util.spec_from_file_location("_sweep_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not isinstance(getattr(module, "PAPER", None), dict) or not module.PAPER:
    raise UserError(
        f"--config={path}: not a sweep config, it has no PAPER dict of rows (row -> (changes, "
        "ppl, bleu, params)); see configs/table3.py"
    )
  return module


def parse_override(text: str) -> tuple[str, object]:
  """ "train.num_steps=2000" -> ("train.num_steps", 2000); a value Python cannot read is a str."""
  key, sep, raw = text.partition("=")
  if not sep or not key:
    raise UserError(f"--override {text!r}: expected KEY=VALUE, e.g. train.num_steps=2000")
  try:
    value = ast.literal_eval(raw)
  except (ValueError, SyntaxError):
    value = raw
  return key, value


def apply_changes(config, changes) -> None:
  """Sets dotted keys ("model.d_ff": 1024) on a config; an unknown key or wrong type is a
  config.ConfigError naming it. A sweep config's `get_config(row)` applies its row with this."""
  for key, value in dict(changes).items():
    *sections, name = key.split(".")
    node = config
    for section in sections:
      if section not in node:
        raise config_lib.ConfigError(f"{key}: the config has no section {section!r}")
      node = node[section]
    if name not in node:
      raise config_lib.ConfigError(f"{key}: the config has no key {name!r}")
    try:
      node[name] = value
    except TypeError as e:  # ml_collections keeps each field's type
      raise config_lib.ConfigError(f"{key}={value!r}: {e}") from e


def row_config(module, row: str, overrides: list[tuple[str, object]]):
  """The row's config with the overrides applied and validated (config.ConfigError if wrong)."""
  config = module.get_config(row)
  apply_changes(config, overrides)
  config_lib.validate(config)
  return config


def command(config_path: str, row: str, workdir: str, overrides: list[str]) -> list[str]:
  return [
      sys.executable,
      str(REPO / "train.py"),
      f"--config={config_path}:{row}",
      f"--workdir={workdir}",
      *(f"--config.{o}" for o in overrides),
  ]


def _absolute(path: str) -> str:
  """A local path made absolute (the rows run in their own processes); URLs as they are."""
  return path if "://" in path else os.path.abspath(path)


def collect(root: str, rows: list[str], paper: dict) -> list[dict]:
  """One record per row: the paper's figures and, where the row finished, the run's."""
  records = []
  for row in rows:
    changes, ppl, bleu, params = paper.get(row, ({}, None, None, None))
    record = {
        "row": row,
        "changes": ", ".join(f"{k.split('.')[-1]}={v}" for k, v in changes.items()) or "-",
        "paper_ppl": ppl,
        "paper_bleu": bleu,
        "paper_params_m": params,
    }
    path = epath.Path(root) / row / "results.json"
    if path.exists():
      results = _read_results(path)
      record.update(
          params=results["num_params"],
          params_m=round(results["num_params"] / 1e6, 1),
          steps=results["step"],
          ppl=round(results["eval_perplexity"], 2),
          bleu=round(results["test_bleu"], 1),
      )
    records.append(record)
  return records


def _read_results(path: epath.Path) -> dict:
  """A finished row's results.json, or a UserError naming the file and what is wrong with it."""
  return files.parse_json(
      path.read_bytes(),
      str(path),
      keys=("num_params", "step", "eval_perplexity", "test_bleu"),
      fix="not the results of a finished training run; move it away to rerun the row",
  )


def markdown(records: list[dict]) -> str:
  columns = [
      ("row", "row"),
      ("changes", "changes"),
      ("params_m", "params (M)"),
      ("steps", "steps"),
      ("ppl", "PPL"),
      ("bleu", "BLEU"),
      ("paper_ppl", "paper PPL"),
      ("paper_bleu", "paper BLEU"),
      ("paper_params_m", "paper params (M)"),
  ]
  lines = [
      "| " + " | ".join(title for _, title in columns) + " |",
      "|" + "---|" * len(columns),
  ]
  for record in records:
    cells = [record.get(key) for key, _ in columns]
    lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
  return "\n".join(lines) + "\n"


def write_table(root: str, rows: list[str], paper: dict) -> list[dict]:
  records = collect(root, rows, paper)
  directory = epath.Path(root)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "table.md").write_text(
      "PPL: perplexity on the eval split, per wordpiece; BLEU: sacreBLEU on the test split "
      "(for Table 3 both are newstest2013). Empty: the row has not finished.\n\n"
      + markdown(records)
  )
  (directory / "table.json").write_text(json.dumps(records, indent=2))
  return records


def main(argv):
  args = cli.workdir_args(argv, required="workdir_root")
  module = load_sweep(args.config)
  rows = args.rows or list(module.PAPER)
  unknown = [r for r in rows if r not in module.PAPER]
  if unknown:
    raise UserError(
        f"--rows: {args.config} has no rows {unknown}; it has {', '.join(module.PAPER)}"
    )
  root = epath.Path(args.workdir_root)
  if root.exists() and not root.is_dir():
    raise UserError(f"--workdir_root {root} is a file, not a directory")
  if args.table_only and not root.is_dir():
    raise UserError(f"--workdir_root {root}: no such directory, so no rows to tabulate")
  overrides = [parse_override(o) for o in args.override]
  if not args.table_only:
    try:  # every row, before any of them trains
      for row in rows:
        row_config(module, row, overrides)
    except ValueError as e:  # config.ConfigError included
      raise UserError(f"row {row}: {e}") from None

  root, failed = _absolute(args.workdir_root), []
  for row in [] if args.table_only else rows:
    workdir = str(epath.Path(root) / row)
    cmd = command(_absolute(args.config), row, workdir, args.override)
    if args.dry_run:
      print(" ".join(cmd))
      continue
    if (epath.Path(workdir) / "results.json").exists():
      logging.info("row %s: done (%s/results.json), skipped", row, workdir)
      continue
    logging.info("row %s: %s", row, " ".join(cmd))
    status = subprocess.run(cmd).returncode
    if status == PREEMPTED:
      logging.warning("row %s was preempted; rerun the same command to resume the sweep", row)
      sys.exit(PREEMPTED)
    if status:
      logging.error("row %s failed (exit status %d); the sweep goes on", row, status)
      failed.append(row)
  if args.dry_run:
    return
  records = write_table(root, rows, module.PAPER)
  print(json.dumps({"table": str(epath.Path(root) / "table.md"), "rows": records}))
  if failed:
    raise UserError(f"rows {failed} failed; see their output above")


if __name__ == "__main__":
  _define_flags()
  cli.run(main)
