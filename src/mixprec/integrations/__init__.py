"""`mixprec.integrations`: mixprec inside the trainers people already use.

* :mod:`mixprec.integrations.lightning`: ``MixprecPrecision``, a Lightning precision plugin, and
  ``MixprecDiagnostics``, a callback that explains a skipped step or a non-finite loss;
* :mod:`mixprec.integrations.fabric`: ``MixprecPrecision``, the same for ``lightning.fabric.Fabric``;
* :mod:`mixprec.integrations.transformers`: ``MixprecTrainer``, the HF ``Trainer`` under a mixprec policy and
  scaler;
* :mod:`mixprec.integrations.accelerate`: ``MixprecAccelerator``, an ``accelerate.Accelerator`` whose
  autocast, loss scaling and unscaling are mixprec's.

Each is an optional extra (``pip install 'mixprec[lightning]'``, ``[transformers]``, ``[accelerate]``) and
imports its framework only when it is itself imported: ``import mixprec`` and ``import
mixprec.integrations`` import none of them.
"""

__all__: list[str] = []
