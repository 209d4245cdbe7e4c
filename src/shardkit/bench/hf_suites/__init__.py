"""Hugging Face suites: ``shardkit.hf`` save/load next to huggingface_hub, safetensors and transformers,
and the in-job export next to DCP's HuggingFaceStorageWriter (``hf_in_job_bench``)."""
