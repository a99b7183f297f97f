"""A hang, then an error: a parameter that one rank does not use.

DDP all-reduces a bucket of gradients once every parameter in it has its gradient. Rank 0 uses the
auxiliary head, rank 1 (a branch that depends on the data: here, on the rank) does not, so rank 1
never completes that bucket: rank 0 waits in the all-reduce, and rank 1's next forward fails with
"Expected to have finished reduction in the prior iteration". TORCH_DISTRIBUTED_DEBUG=INFO adds the
names of the parameters that got no gradient on which rank. The fix (`--fixed`):
find_unused_parameters=True, which lets DDP mark them ready after each forward (at the cost of a walk
of the autograd graph every step); or make every rank use every parameter.

    TORCH_DISTRIBUTED_DEBUG=INFO torchrun --nproc_per_node=2 src/ch4/debugging/unused_parameter.py
    torchrun --nproc_per_node=2 src/ch4/debugging/unused_parameter.py --fixed
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.gallery import batches, start


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(16, 4)
        self.aux = torch.nn.Linear(16, 4)  # an auxiliary head, used on some batches only

    def forward(self, inputs, use_aux: bool):
        outputs = self.body(inputs)
        return outputs + self.aux(inputs) if use_aux else outputs


def main():
    args, launch, device = start(__doc__, "src/ch4/debugging/unused_parameter.py")
    torch.manual_seed(0)
    model = DDP(Net().to(device), find_unused_parameters=args.fixed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step, (inputs, labels) in enumerate(batches(device, seed=launch.rank)):
        optimizer.zero_grad()
        F.cross_entropy(model(inputs, use_aux=launch.rank == 0), labels).backward()
        optimizer.step()
    if launch.rank == 0:
        print(f"trained {step + 1} steps")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
