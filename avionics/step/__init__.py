"""The stages of a tracked step, one concern per module (the cockpit runs them in order).

``with cockpit(step, info):`` runs, in :class:`~avionics.cockpit.Cockpit`:

1. enter: every check of the step, its ``info`` and its micro-batch
   (:mod:`~avionics.step.checks`), and the global batch's loss and size
   (:mod:`~avionics.step.batch` on one process, :mod:`~avionics.step.parallel` under data
   parallelism); nothing changes before it returns;
2. the backward, the user's block, with hooks that record its gradients and the scale of the
   loss it backpropagated (:mod:`~avionics.step.precision`);
3. leave: a micro-batch that is not the last is kept (:mod:`~avionics.step.accumulation`);
4. finish: the step's micro-batches as one batch (:mod:`~avionics.step.batch`, or
   :mod:`~avionics.step.accumulation` for k > 1), its global gradients
   (:mod:`~avionics.step.parallel`), the quantities' values (:mod:`~avionics.step.compute`)
   and their storage (:mod:`~avionics.step.output`), after the one host transfer of their
   values (:mod:`~avionics.step.transfer`).

A tracked plain step reads the device twice: after the backward, the scale of the loss with
whether the loss and the gradients are finite (:func:`~avionics.step.batch.one_batch`), and at
the storage, every value's finiteness with the numbers the quantities decide on the host
(:class:`~avionics.quantities.deferred.Deferred`); an untracked step never does.

The values that pass between the stages are in :mod:`~avionics.step.values`, which imports
none of the others. A plain step (one batch, one process) runs through
:mod:`~avionics.step.batch` only, never the accumulation or data-parallel code.
"""
