"""Tensor parallelism: a decoder split over N processes through torch.distributed (engine/parallel/ranks.py)."""
