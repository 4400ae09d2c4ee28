"""Preemption: a SIGTERM ends training at the next step with a checkpoint; rerunning resumes.

Schedulers announce an eviction with SIGTERM and kill the job a grace period later (SLURM's
GraceTime, Kubernetes' terminationGracePeriodSeconds, Compute Engine / Cloud TPU preemption).
`train.run` asks `Preemption.reached(step)` after every step; when it says yes the loop saves a
checkpoint of that step (off the `checkpoint_every` interval), waits for it to be complete,
skips the final evaluation and returns `stopped_by="preemption"`; `train.py` then exits with
status 143 (128 + SIGTERM), as a process killed by SIGTERM would, so a scheduler or wrapper loop
sees that the run is not finished. The same command resumes it exactly (the data iterator's
position is in the checkpoint).

One process: a Python signal handler sets a flag, and the step after the signal is saved.

Several processes (`jax.distributed`): every process must save the same step, since Orbax writes
one checkpoint collectively, yet the notice reaches them at different steps, or reaches only
some. JAX's preemption service (on by default with `jax.distributed.initialize`) catches SIGTERM
itself, tells every process, and agrees on a step past all of theirs;
`multihost_utils.reached_preemption_sync_point(step)` is True on every process at that step.
No Python handler is installed then, which would replace JAX's.
"""

from __future__ import annotations

import logging
import signal
import threading

import jax

EXIT_STATUS = 128 + signal.SIGTERM  # 143: what a shell reports for a process SIGTERM killed


class Preemption:
  """Context manager: `with Preemption() as p: ... if p.reached(step): save and stop`.

  In a single-process run entered on the main thread (the only one Python delivers signals to)
  it installs a SIGTERM handler, and restores the previous one on exit, so library and test use
  leave no trace; on another thread SIGTERM keeps its previous action.
  """

  def __init__(self):
    self._requested = threading.Event()
    self._previous = None
    self._installed = False
    self._service_off = False

  def __enter__(self) -> Preemption:
    if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
      self._installed = True
    return self

  def __exit__(self, *exc) -> None:
    if self._installed:
      signal.signal(signal.SIGTERM, self._previous)
      self._installed = False

  def _on_sigterm(self, signum, frame) -> None:
    del signum, frame
    # Only set a flag: the handler runs between two bytecodes of the training loop.
    self._requested.set()

  @property
  def requested(self) -> bool:
    """Whether this process has received SIGTERM (single-process runs)."""
    return self._requested.is_set()

  def reached(self, step: int) -> bool:
    """True at the step every process should checkpoint and stop at; call it at every step."""
    if jax.process_count() > 1:
      if self._service_off:
        return False
      from jax.experimental import multihost_utils

      try:
        return multihost_utils.reached_preemption_sync_point(step)
      except RuntimeError as e:  # jax_enable_preemption_service=False: train on, unprotected
        logging.warning("no preemption checkpoints in this multi-process run: %s", e)
        self._service_off = True
        return False
    if self.requested:
      logging.warning("SIGTERM received: saving a checkpoint at step %d and stopping", step)
      return True
    return False
