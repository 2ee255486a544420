"""`mixprec.integrations`: mixprec inside the trainers people already use.

* :mod:`mixprec.integrations.lightning`: ``MixprecPrecision``, a Lightning precision plugin,
  ``MixprecDiagnostics``, a callback that explains a skipped step or a non-finite loss, and
  ``MixprecReplan``, a callback that re-plans the layers' formats during training;
* :mod:`mixprec.integrations.fabric`: ``MixprecPrecision``, the same for ``lightning.fabric.Fabric``;
* :mod:`mixprec.integrations.transformers`: ``MixprecTrainer``, the HF ``Trainer`` under a mixprec policy and
  scaler, and ``MixprecReplanCallback``, the re-planning callback for any ``Trainer``;
* :mod:`mixprec.integrations.accelerate`: ``MixprecAccelerator``, an ``accelerate.Accelerator`` whose
  autocast, loss scaling and unscaling are mixprec's.

Each is an optional extra (``pip install 'mixprec[lightning]'``, ``[transformers]``, ``[accelerate]``) and
imports its framework only when it is itself imported: ``import mixprec`` and ``import
mixprec.integrations`` import none of them. ``ReplanSchedule``, what both re-planning callbacks drive
(Fabric and plain loops call it themselves), is :class:`mixprec.plan.ReplanSchedule`.
"""

__all__: list[str] = []
