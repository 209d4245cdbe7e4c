"""Communication suites: ``Group`` collectives next to ``torch.distributed`` (CPU and GPU), and a DDP step."""
