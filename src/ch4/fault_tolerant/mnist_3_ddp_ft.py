"""MNIST, step 3 without restarts: replica groups that lose a member, keep training, and heal it
from a live peer.

mnist_3_ddp.py stops when one process dies; the resume chapter starts every process again from the last
checkpoint. Here (torchft) the job is split into replica groups, and a lighthouse forms a quorum of the live
groups before every step. What changes:
  - each replica group is its own torchrun (here one process each) with its own number, --group, and a
    Manager that asks the lighthouse which groups take the next step;
  - after backward, the gradients are averaged over the groups in that step's quorum (manager.allreduce),
    and torchft's Optimizer steps only if every one of them got through the step (should_commit);
  - a group that dies drops out of the next quorum and the others go on, with fewer samples per step;
  - a group that starts late, or again, is behind: the quorum tells it to heal, and it loads the weights,
    the optimizer's moments and the step from a live peer (the state functions below), not from a file;
  - the loop counts the quorum's steps (--max-steps), and the data position is that step: step k trains
    on batch k of this group's shard of the shuffle, so a group that healed goes on at its peers' batch;
  - every group starts from the same weights (one seed), and evaluates the whole test set itself.
Not torchft's DistributedDataParallel: at torchft 0.2.0 its gradient hook fails an assertion when a peer dies
during the all-reduce, which ends the survivor too (common/fault_tolerance.py says more).

Run from the repository root, on one machine: a lighthouse, then one torchrun per group (here 3):
    torchft_lighthouse --min_replicas 1 --join_timeout_ms 1000 --quorum_tick_ms 100 --bind '[::]:29510' &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510 NUM_REPLICA_GROUPS=3
    for g in 0 1 2; do torchrun --standalone --nproc_per_node=1 \\
        src/ch4/fault_tolerant/mnist_3_ddp_ft.py --group $g --batch-size 96 & done
Kill a group, its torchrun and its worker (pkill -KILL -f 'mnist_3_ddp_ft.py --group 1'), and start that
group's command again: it rejoins and heals. On several machines: the lighthouse on one,
TORCHFT_LIGHTHOUSE=http://THAT_HOST:29510 everywhere, any groups on each. Under SLURM, a lighthouse step and
one task per group:
    sbatch -N3 slurm/fault_tolerant.sbatch src/ch4/fault_tolerant/mnist_3_ddp_ft.py --batch-size 96

It rewrites much of mnist_3_ddp.py, so its page shows it whole;
`python tools/stepdiff.py src/ch4/mnist_3_ddp.py src/ch4/fault_tolerant/mnist_3_ddp_ft.py` shows the change.
"""
import time

import torch
import torch.nn.functional as F

from common.cli import add_compile_flag, add_fault_tolerance_flags, mnist_parser, per_process_batch
from common.compile import compile_in_place
from common.distributed import device_for, require_launcher
from common.fault_tolerance import (
    StepBatches,
    StepLog,
    average_gradients,
    check_group,
    quorum_errors,
    refuse_another_run,
    require_torchft,
    run_settings,
    timeouts,
)
from common.mnist import BasicNet, load_mnist, mnist_loader
from common.precision import autocast, grad_scaler, resolve_precision
from common.samplers import ResumableDistributedSampler

torchft = require_torchft()  # one sentence saying what to install, where it is missing


def train_steps(model, batches, optimizer, scaler, manager, device, precision, max_steps, log, healed):
    """Steps until the quorum's step reaches max_steps; returns the mean training loss of the steps taken."""
    model.train()
    loss_sum = torch.zeros((), device=device)
    while manager.current_step() < max_steps:  # the quorum's step: a heal moves it forward
        step = manager.current_step()
        images, labels = batches(step)  # batch `step` of this group's shard
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            loss = F.nll_loss(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        average_gradients(model, manager)  # over the quorum's groups (a healing group adds zeros)
        scaler.step(optimizer)
        scaler.update()
        loss_sum += loss.detach()
        participants, heal = manager.num_participants(), bool(healed)
        if log.step(manager.current_step(), participants, manager.current_step() != step, heal):  # a new quorum, or a heal
            print(f"group {log.group}: step {manager.current_step()}, "
                  f"{participants} of {log.groups} groups in the quorum"
                  + (", healed from a live peer" if heal else ""), flush=True)
        healed.clear()
    return loss_sum.item() / max(log.steps_run, 1)


@torch.no_grad()
def evaluate(model, loader, device, precision):
    """Count correct predictions and images seen, so that the caller knows what the accuracy is over."""
    model.eval()
    correct = seen = 0
    for images, labels in loader:
        images = images.to(device, memory_format=torch.channels_last, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        with autocast(device, precision):
            predictions = model(images).argmax(dim=1)
        correct += (predictions == labels).sum().item()
        seen += labels.numel()
    return correct, seen


def main():
    args = add_fault_tolerance_flags(add_compile_flag(mnist_parser(__doc__))).parse_args()

    launch = require_launcher("src/ch4/fault_tolerant/mnist_3_ddp_ft.py")
    check_group(args, launch, "src/ch4/fault_tolerant/mnist_3_ddp_ft.py")  # one process a group, a lighthouse
    device = device_for(launch)
    precision = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed)  # the same initial weights in every group: nothing to copy at step 0

    train_set, test_set = load_mnist(args.data_dir, args.loader, launch.local_rank)
    batch_size = per_process_batch(args.batch_size, args.groups)  # each group loads 1/G of the global batch
    train_sampler = ResumableDistributedSampler(train_set, batch_size, num_replicas=args.groups,
                                                rank=args.group, seed=args.seed)  # this group's 1/G of the shuffle, from any batch on
    train_loader = mnist_loader(train_set, batch_size, train_sampler, args.num_workers, torch.Generator())
    test_loader = mnist_loader(test_set, args.eval_batch_size, None, args.num_workers)  # each group scores all

    model = BasicNet().to(device, memory_format=torch.channels_last)
    torch.manual_seed(args.seed + 1 + args.group)  # own dropout masks per group
    manager = torchft.Manager(  # this group's seat in the quorum
        pg=(torchft.ProcessGroupGloo if device.type == "cpu"  # across groups
            else torchft.ProcessGroupNCCL)(timeouts(args)["timeout"]),
        load_state_dict=None, state_dict=None,  # registered below, once the optimizer is wrapped
        min_replica_size=1, replica_id=f"mnist_ft_{args.group}", lighthouse_addr=args.lighthouse,  # the lighthouse sets the minimum
        init_sync=False, **timeouts(args))  # init_sync=False: the seed made the weights equal
    compile_in_place(model, args.compile)  # in place: the state a peer sends keeps the model's own keys
    optimizer = torchft.Optimizer(manager, torch.optim.AdamW(model.parameters(), lr=args.lr))  # zero_grad asks for the quorum, step commits or skips
    scaler = grad_scaler(device, precision)
    healed = []
    max_steps = args.max_steps or args.epochs * len(train_loader)
    settings = run_settings(args, precision, len(train_set), max_steps)  # what every group of this run shares

    def load_state(state):  # torchft calls it on a group that heals, with a live peer's state
        refuse_another_run(state["run"], settings, args.group)  # a peer started with other flags: one sentence
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        healed.append(True)

    manager.register_state_dict_fn("training", load_state, lambda: {  # what a live peer sends
        "run": settings, "model": model.state_dict(), "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict()})
    log = StepLog(args.step_log, args.group, args.groups)

    print(f"group {args.group} of {args.groups} on {device.type}, {precision}, "
          f"global batch {args.batch_size} = "
          f"{args.groups} x {batch_size}, {max_steps} steps", flush=True)
    start = time.perf_counter()
    loss = train_steps(model, StepBatches(train_loader), optimizer, scaler, manager, device, precision,
                       max_steps, log, healed)
    train_seconds = time.perf_counter() - start
    print(f"group {args.group}: mean training loss {loss:.4f} over the {log.steps_run} steps it took, "
          f"{log.heals} heal(s)", flush=True)

    correct, seen = evaluate(model, test_loader, device, precision)  # the model itself: no wrapper
    print(f"group {args.group}: train time {train_seconds:.1f} s, "
          f"test accuracy {correct / seen:.2%} over {seen} images")
    if args.save:
        torch.save(model.state_dict(), args.save)
    log.summary(args.summary, manager.current_step(), correct / seen)
    manager.shutdown()


if __name__ == "__main__":
    with quorum_errors():  # no lighthouse, or no quorum in time: one sentence
        main()
