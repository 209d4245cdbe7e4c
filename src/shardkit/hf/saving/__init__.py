"""Saving Hugging Face checkpoints: ``save_checkpoint`` (``save.py``), the export plan and its writes, the
in-job save of DTensor states (``job_save.py``, gathering whole tensors: ``gather.py``) and the checks."""
