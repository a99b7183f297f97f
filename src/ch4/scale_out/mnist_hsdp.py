"""MNIST with HSDP (hybrid sharding): mnist_fsdp.py's fully_shard over a 2-D device mesh, sharded within a
node and replicated across nodes.

FSDP shards every parameter over all N ranks, so each layer's all-gathers and reduce-scatter cross the
network between nodes, which is several times slower than the links inside one (NVLink). HSDP lays the
N = R x S ranks out as a 2-D DeviceMesh with dimensions ("replicate", "shard"): each parameter is cut
into S pieces along "shard", and each piece is held by R replicas along "replicate". In one training
step, per wrapped layer:
  - all-gather its parameters before its forward and again before its backward, among the S ranks of
    its shard group (one node), and reduce-scatter its gradients there;
  - all-reduce each rank's gradient piece (1/S of the layer) with the R ranks of its replicate group,
    the same GPU of every node: the only collective that crosses nodes.
Each rank holds 1/S of the model, its gradients and AdamW state (FSDP holds 1/N, DDP all of it).
How the mesh maps onto the machines: torchrun numbers ranks node by node (node n runs ranks
n*L .. n*L+L-1, L = --nproc_per_node) and init_device_mesh lays them out row by row (rank r at
(r // S, r % S)), so with S = L each row, a shard group, is one node and each column, a replicate group,
is GPU g of every node. --replicas R picks the mesh; the default, R = WORLD_SIZE / LOCAL_WORLD_SIZE (the
number of nodes), is that layout. R = 1 is plain FSDP (one shard group of N), R = N is DDP-like (S = 1:
no all-gather, an all-reduce per layer). What changes from mnist_fsdp.py:
  - the device mesh, and fully_shard(..., mesh=mesh) on each layer and on the model;
  - --param-dtype bf16: FSDP2's MixedPrecisionPolicy, which all-gathers the parameters and computes in
    bf16 but reduces the gradients in fp32, into the fp32 pieces AdamW steps (the mixed precision FSDP2
    does itself, in place of autocast; keep --precision fp32 with it).
Accelerate calls it HSDP: FSDP2 with ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)
(accelerate launch --parallelism_config_dp_replicate_size R --parallelism_config_dp_shard_size S), or
its FSDP1 plugin's sharding strategy HYBRID_SHARD. Lightning: FSDPStrategy(sharding_strategy="HYBRID_SHARD",
device_mesh=(R, S)) (FSDP1); for FSDP2, ModelParallelStrategy, where the LightningModule's configure_model
calls fully_shard on the strategy's device mesh.

Run from the repository root (MNIST is downloaded to ./data; --data-dir DIR reads a copy in DIR/MNIST/raw):
    # one machine: 2 x 2 (4 GPUs, or 4 CPU processes)
    torchrun --nproc_per_node=4 src/ch4/scale_out/mnist_hsdp.py --replicas 2
    # on each of 2 nodes: mesh 2 x 8
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 --rdzv_id=hsdp \\
        src/ch4/scale_out/mnist_hsdp.py
HOST is the first node's address (any node both can reach); every node runs the same command. On a CPU
torchrun sets OMP_NUM_THREADS=1 per process, so N processes use N cores.

Lines marked `# STEP` are what this step changes in mnist_fsdp.py.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data.distributed import DistributedSampler

from common.cli import (
    PARAM_DTYPES,
    add_compile_flag,
    add_hsdp_flags,
    mesh_shape,
    mnist_parser,
    per_process_batch,
)
from common.compile import compile_in_place
from common.distributed import (
    backend_for,
    device_for,
    exit_if_peers_missing,
    exit_process,
    print0,
    processes,
    require_launcher,
)
from common.gather import sum_across_ranks
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import autocast, grad_scaler, resolve_precision
from common.samplers import DistributedEvalSampler


def shard(model, mesh, policy, backend=None):  # STEP
    ('fully_shard each layer, then the model: on a 2-D mesh, cut along "shard" and copied along '  # STEP
     '"replicate".')  # STEP
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):  # STEP: one all-gather per layer, then freed
        fully_shard(layer, mesh=mesh, mp_policy=policy)  # STEP
        compile_in_place(layer, backend)  # STEP: --compile: each block alone, as in mnist_fsdp.py
    fully_shard(model, mesh=mesh, mp_policy=policy)  # STEP: the root, which owns no parameters here
    return model  # STEP


def train_epoch(model, loader, optimizer, scaler, device, precision):
    """One pass over this process's share of the training set; returns the mean training loss."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach()
    return loss_sum.item() / len(loader)


@torch.no_grad()
def evaluate(model, loader, device, precision, unpadded):
    """Count correct predictions and images seen among this rank's first `unpadded` images."""
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            predictions = model(images).argmax(dim=1)
        keep = min(labels.numel(), unpadded - seen)
        correct += (predictions[:keep] == labels[:keep]).sum().item()
        seen += keep
    return correct, seen


def main():
    args = add_hsdp_flags(add_compile_flag(mnist_parser(__doc__))).parse_args()  # STEP: --replicas R, --param-dtype

    launch = require_launcher("src/ch4/scale_out/mnist_hsdp.py")  # STEP
    replicas, shards = mesh_shape(args.replicas, launch.world_size, launch.local_world_size)  # STEP: one sentence if R does not divide N
    device = device_for(launch)
    timeout = timedelta(seconds=args.dist_timeout)
    if device.type != "cpu":
        torch.get_device_module(device).set_device(device)
    with exit_if_peers_missing(launch, args.dist_timeout):
        dist.init_process_group(backend_for(device), rank=launch.rank, world_size=launch.world_size,
                                timeout=timeout, device_id=device if device.type != "cpu" else None)
        dist.barrier(async_op=True).wait(timeout=timeout)
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed + launch.rank)

    train_set, test_set = load_mnist(args.data_dir, args.loader, launch.local_rank)
    batch_size = per_process_batch(args.batch_size, launch.world_size)
    train_sampler = DistributedSampler(train_set, seed=args.seed)
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers)
    test_loader = mnist_loader(test_set, args.eval_batch_size,
                               DistributedSampler(test_set, shuffle=False), args.num_workers)
    unpadded = len(DistributedEvalSampler(test_set))

    model = BasicNet().to(device)
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    mesh = init_device_mesh(device.type, (replicas, shards), mesh_dim_names=("replicate", "shard"))  # STEP: rank r at (r // S, r % S)
    policy = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[args.param_dtype], reduce_dtype=torch.float32)  # STEP
    shard(model, mesh, policy, args.compile)  # STEP: model.parameters() are now this rank's pieces
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scaler = grad_scaler(device, precision)

    print0(f"{processes(launch.world_size)} on {device.type}, {precision}, global batch "
           f"{args.batch_size} = {launch.world_size} x {batch_size}")
    print0(f"mesh (replicate, shard) = {replicas} x {shards}: shard groups (rows) {mesh.mesh.tolist()}, "  # STEP
           f"parameters in {args.param_dtype}, gradients reduced in fp32")  # STEP
    train_seconds = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        start = time.perf_counter()
        loss = train_epoch(model, train_loader, optimizer, scaler, device, precision)
        train_seconds += time.perf_counter() - start
        loss = sum_across_ranks(loss, device=device)[0] / launch.world_size
        print0(f"epoch {epoch}: mean training loss {loss:.4f}")

    correct, seen = evaluate(model, test_loader, device, precision, unpadded)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"train time {train_seconds:.1f} s, {args.epochs * len(train_set) / train_seconds:.0f} samples/s")
    print0(f"test accuracy {correct / seen:.2%} over {seen} images")
    dist.destroy_process_group()
    exit_process()


if __name__ == "__main__":
    main()
