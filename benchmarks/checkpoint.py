"""What the checkpoint digest costs: save and restore of a train state with and without it.

  python benchmarks/checkpoint.py [--config configs/base.py] [--vocab_size 37000] [--repeats 3]

Builds the config's train state (parameters and Adam moments, the moments filled with noise as a
trained run's are; base: 63M parameters, 0.76 GB of float32 state) on this process's devices,
then, alternating in one process, saves it as a run does (`checkpoint.save` through
`checkpoint.make_manager`: the state, the data position and the record of their files,
runs/digest.py) and as Orbax alone would (a plain CheckpointManager, the same items), until each
save is committed; and restores it as a resumed run does (`checkpoint.restore`, which checks the
files first) and without the check. `save*_blocking`: the time the save call holds the training
loop (Orbax writes the arrays, and the record is taken, in the background); `save*`: until the
checkpoint is committed. Also the record alone, over the files of a saved step. Medians of
`--repeats`; one JSON line.
"""

import json
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere

from benchmarks import machine  # noqa: E402

_CONFIG = flags.DEFINE_string("config", "configs/base.py", "The config whose model to save.")
_VOCAB = flags.DEFINE_integer("vocab_size", 37000, "Vocabulary size (base: §5.1's 37,000).")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Repeats per figure (the median is reported).")


def _seconds(fn) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def main(argv):
  del argv
  import importlib.util  # noqa: PLC0415

  import jax  # noqa: PLC0415
  import orbax.checkpoint as ocp  # noqa: PLC0415

  from transformer_jax import config as config_lib  # noqa: PLC0415
  from transformer_jax.runs import checkpoint, digest  # noqa: PLC0415
  from transformer_jax.training import train  # noqa: PLC0415

  spec = importlib.util.spec_from_file_location("bench_config", _CONFIG.value)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config(None)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  trainer = train.Trainer(
      config, config_lib.model_config(config, _VOCAB.value), devices=jax.devices()[:1]
  )
  state = trainer.init_state(0)
  # A trained run's Adam moments are not the zeros of a new one, and zeros compress to nothing:
  # noise in their place makes the files as large as a trained run's.
  key = jax.random.PRNGKey(1)
  state = state.replace(
      opt_state=jax.tree.map(
          lambda x: x + 1e-3 * jax.random.normal(key, x.shape, x.dtype)
          if x.ndim and jax.numpy.issubdtype(x.dtype, jax.numpy.floating)
          else x,
          state.opt_state,
      )
  )
  abstract = trainer.abstract_state()
  data = {"epoch": 0, "position": 12345, "train_seconds": 1.0}
  leaves = jax.tree.leaves(state)
  state_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
  params = sum(x.size for x in jax.tree.leaves(state.params))

  root = pathlib.Path(tempfile.mkdtemp(prefix="checkpoint_bench_"))
  kinds = ("save", "save_digest", "save_blocking", "save_digest_blocking")
  times = {k: [] for k in (*kinds, "restore", "restore_verified", "digest")}
  try:
    for repeat in range(_REPEATS.value):
      for kind in ("save", "save_digest"):
        workdir = root / f"{kind}{repeat}"
        if kind == "save_digest":
          manager = checkpoint.make_manager(str(workdir), keep=1, save_every=1)
          save = lambda m=manager: checkpoint.save(m, 1, state, data, force=True)
        else:
          manager = ocp.CheckpointManager(
              workdir / "checkpoints",
              options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True),
              item_names=("state", "data"),
          )
          args = ocp.args.Composite(
              state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data)
          )
          save = lambda m=manager, a=args: m.save(1, args=a, force=True)
        start = time.perf_counter()
        save()
        times[f"{kind}_blocking"].append(time.perf_counter() - start)
        manager.wait_until_finished()
        times[kind].append(time.perf_counter() - start)
        if kind == "save_digest":
          times["restore_verified"].append(
              _seconds(lambda m=manager: jax.block_until_ready(checkpoint.restore(m, abstract, 1)))
          )
          args = ocp.args.Composite(
              state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()
          )
          step_dir = workdir / "checkpoints" / "1"
          times["digest"].append(
              _seconds(lambda d=step_dir: digest.record_files(d, subdirectories=True))
          )
          times["restore"].append(
              _seconds(
                  lambda m=manager, a=args: jax.block_until_ready(m.restore(1, args=a)["state"])
              )
          )
        manager.close()
        shutil.rmtree(workdir)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  med = {k: round(statistics.median(v), 3) for k, v in times.items()}
  print(
      json.dumps(
          {
              "benchmark": "checkpoint",
              "config": _CONFIG.value,
              "parameters": int(params),
              "state_bytes": int(state_bytes),
              "arrays": len(leaves),
              "repeats": _REPEATS.value,
              **{f"{k}_s": v for k, v in med.items()},
              "save_ratio": round(med["save_digest"] / med["save"], 3),
              "save_blocking_ratio": round(med["save_digest_blocking"] / med["save_blocking"], 3),
              "restore_ratio": round(med["restore_verified"] / med["restore"], 3),
              "all_s": {k: [round(x, 3) for x in v] for k, v in times.items()},
              "device": jax.devices()[0].device_kind,
              **machine.describe(),
          }
      )
  )


if __name__ == "__main__":
  app.run(main)
