"""FSDP2's fully_shard and MixedPrecisionPolicy under one import for every supported torch.

torch 2.6 made them public in torch.distributed.fsdp; torch 2.4 and 2.5 ship the same ones in
torch.distributed._composable.fsdp.
"""
try:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = ["MixedPrecisionPolicy", "fully_shard"]
