"""MNIST with FSDP2 in fault-tolerant replica groups: HSDP's shape, with torchft across the replica dimension.

Each replica group is mnist_fsdp.py's job: N processes (one torchrun), each holding 1/N of the model, its
gradients and AdamW's moments. Across the groups, the replica dimension of HSDP (docs/hsdp.md),
torchft takes the
place of a fixed process group: a lighthouse forms a quorum of the live groups before every step, a group that
dies drops out, and one that comes back heals from a live peer, rank r from rank r, each its own pieces.
What changes from mnist_fsdp.py (mnist_3_ddp_ft.py explains the torchft lines):
  - inside a group, FSDP2 reduce-scatters the gradients as before; then each rank averages its pieces with the
    same pieces of the other groups in the quorum (manager.allreduce, one flat buffer);
  - the state a peer sends is this rank's pieces as plain tensors (local_shards), made DTensors again on the
    healing rank's own mesh (sharded_like): a DTensor does not travel between processes with its mesh;
  - torchft reads that state in its quorum thread, while this rank's forward and backward run:
    FSDP2 then holds
    some layers gathered whole in place of their pieces, so reading is disallowed until backward has ended
    (disallow_state_dict_read, torchft's own lock for this);
  - a group's rank 0 writes the log and the summary, and --save gathers the full weights (full_tensor).

Run from the repository root, on one machine, 2 groups of 2 processes (docs/fault_tolerant.md):
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --quorum_tick_ms 100 --bind '[::]:29510' &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=2
    for g in 0 1; do torchrun --standalone --nproc_per_node=2 \\
        src/ch4/fault_tolerant/mnist_fsdp_ft.py --group $g --batch-size 64 & done

It rewrites much of sharded/mnist_fsdp.py, so its page shows it whole;
`python tools/stepdiff.py src/ch4/sharded/mnist_fsdp.py src/ch4/fault_tolerant/mnist_fsdp_ft.py`
shows the change.
"""
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data.distributed import DistributedSampler

from common.cli import add_compile_flag, add_fault_tolerance_flags, mnist_parser, per_process_batch
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
from common.fault_tolerance import (
    StepBatches,
    StepLog,
    average_gradients,
    check_group,
    local_shards,
    quorum_errors,
    refuse_another_run,
    require_torchft,
    run_settings,
    sharded_like,
    sharded_optimizer_state,
    timeouts,
)
from common.gather import sum_across_ranks
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import autocast, grad_scaler, resolve_precision
from common.samplers import DistributedEvalSampler, ResumableDistributedSampler

torchft = require_torchft()


def train_steps(model, batches, optimizer, scaler, manager, device, precision, max_steps, log, healed):
    """Steps until the quorum's step reaches max_steps; returns the mean training loss of the steps taken."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    while manager.current_step() < max_steps:
        step = manager.current_step()
        images, labels = batches(step)
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        manager.disallow_state_dict_read()  # forward and backward gather layers whole in place of their pieces...
        with autocast(device, precision):
            loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad(set_to_none=True)  # ...while the quorum starts here, and may send a healing peer our state
        scaler.scale(loss).backward()
        manager.allow_state_dict_read()  # pieces again: the quorum's thread may read them now
        average_gradients(model, manager)  # this rank's pieces, with the same pieces of the other groups
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach()
        participants, heal = manager.num_participants(), bool(healed)
        if log.step(manager.current_step(), participants, manager.current_step() != step, heal):
            print0(f"group {log.group}: step {manager.current_step()}, "
                   f"{participants} of {log.groups} groups in the quorum"
                   + (", healed from a live peer" if heal else ""))
        healed.clear()
    return loss_sum.item() / max(log.steps_run, 1)


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
    args = add_fault_tolerance_flags(add_compile_flag(mnist_parser(__doc__))).parse_args()

    launch = require_launcher("src/ch4/fault_tolerant/mnist_fsdp_ft.py")
    check_group(args, launch, "src/ch4/fault_tolerant/mnist_fsdp_ft.py", one_process=False)
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
    batch_size = per_process_batch(args.batch_size, args.groups * launch.world_size)  # G groups of N
    train_sampler = ResumableDistributedSampler(
        train_set, batch_size, num_replicas=args.groups * launch.world_size,
        rank=args.group * launch.world_size + launch.rank, seed=args.seed)
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers, torch.Generator())
    test_loader = mnist_loader(test_set, args.eval_batch_size,
                               DistributedSampler(test_set, shuffle=False), args.num_workers)
    unpadded = len(DistributedEvalSampler(test_set))

    model = BasicNet().to(device)
    for tensor in model.state_dict().values():
        dist.broadcast(tensor, src=0)
    for layer in (model.conv1, model.conv2, model.fc1, model.fc2):
        fully_shard(layer)
        compile_in_place(layer, args.compile)
    fully_shard(model)
    manager = torchft.Manager(  # one per rank; rank 0's speaks to the lighthouse for the group
        pg=(torchft.ProcessGroupGloo if device.type == "cpu"  # rank r of each group
            else torchft.ProcessGroupNCCL)(timeouts(args)["timeout"]),
        load_state_dict=None, state_dict=None, min_replica_size=1, replica_id=f"mnist_fsdp_ft_{args.group}",
        lighthouse_addr=args.lighthouse, init_sync=False, **timeouts(args))
    optimizer = torchft.Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=args.lr))
    scaler = grad_scaler(device, precision)
    healed = []
    max_steps = args.max_steps or args.epochs * len(train_loader)
    settings = run_settings(args, precision, len(train_set), max_steps) | {
        "processes per group": launch.world_size}

    def load_state(state):  # this rank's pieces from the same rank of a live group, made DTensors here
        refuse_another_run(state["run"], settings, args.group)  # a peer started with other flags: one sentence
        model.load_state_dict(sharded_like(state["model"], model.state_dict()))
        optimizer.load_state_dict(sharded_optimizer_state(state["optimizer"], list(model.parameters())))
        scaler.load_state_dict(state["scaler"])
        healed.append(True)

    manager.register_state_dict_fn("training", load_state, lambda: local_shards({  # plain tensors travel
        "run": settings, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict()}))
    log = StepLog(args.step_log if launch.rank == 0 else None, args.group, args.groups)

    print0(f"group {args.group} of {args.groups}: {processes(launch.world_size)} on {device.type}, "
           f"{precision}, global batch "
           f"{args.batch_size} = {args.groups} x {launch.world_size} x {batch_size}, {max_steps} steps")
    start = time.perf_counter()
    loss = train_steps(model, StepBatches(train_loader), optimizer, scaler, manager, device, precision,
                       max_steps, log, healed)
    train_seconds = time.perf_counter() - start
    print0(f"group {args.group}: mean training loss {loss:.4f} over the {log.steps_run} steps it took, "
           f"{log.heals} heal(s)")

    correct, seen = evaluate(model, test_loader, device, precision, unpadded)
    correct, seen = sum_across_ranks(correct, seen, device=device)
    print0(f"group {args.group}: train time {train_seconds:.1f} s, "
           f"test accuracy {correct / seen:.2%} over {seen} images")
    weights = {name: tensor.full_tensor() for name, tensor in model.state_dict().items()}  # gathered on every rank
    if args.save and launch.rank == 0:
        torch.save(weights, args.save)
    log.summary(args.summary if launch.rank == 0 else None, manager.current_step(), correct / seen)
    manager.shutdown()
    dist.destroy_process_group()
    exit_process()


if __name__ == "__main__":
    with quorum_errors():
        main()
