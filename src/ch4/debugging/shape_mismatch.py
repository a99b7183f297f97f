"""A hang: one collective called with different shapes on different ranks.

101 evaluation examples over 2 ranks are 51 and 50. `dist.all_gather` needs the same shape on every
rank: rank 0 sends 51 predictions where rank 1 expects 50. Gloo then aborts ("Received data size
doesn't match expected size"), times out, or with other sizes reads garbage; different dtypes (a
float tensor on one rank, a long one on another) do the same. TORCH_DISTRIBUTED_DEBUG=DETAIL compares
the shapes and dtypes first and names both ranks. The fix (`--fixed`): gather_uneven
(common/gather.py) first exchanges the lengths, pads to the longest and drops the padding.

    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --nproc_per_node=2 src/ch4/debugging/shape_mismatch.py
    torchrun --nproc_per_node=2 src/ch4/debugging/shape_mismatch.py --fixed
"""
import torch
import torch.distributed as dist

from common.gallery import start
from common.gather import gather_uneven


def main():
    args, launch, device = start(__doc__, "src/ch4/debugging/shape_mismatch.py")
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4).to(device)
    inputs = torch.randn(101, 16)[launch.rank::launch.world_size].to(device)  # 51 and 50 examples
    with torch.no_grad():
        predictions = model(inputs).argmax(1)
    if args.fixed:
        everything = gather_uneven(predictions)
    else:
        parts = [torch.empty_like(predictions) for _ in range(launch.world_size)]  # the bug: assumes equal shares
        dist.all_gather(parts, predictions)
        everything = torch.cat(parts)
    if launch.rank == 0:
        print(f"gathered {len(everything)} predictions")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
