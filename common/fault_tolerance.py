"""What the fault-tolerant rungs share (src/ch4/fault_tolerant/): torchft, or one sentence where it is missing; the
replica group's checks (its flags are common/cli.py's add_fault_tolerance_flags), and a heal's check that its peer is
of the same run; the batch of a step; and the per-step log and the summary that the tests and the figure read."""
import contextlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from common.checkpoint import another_run
from common.distributed import exit_process

INSTALL = ("pip install torchft==0.2.0 (Linux, Python 3.10 to 3.12, torch 2.7 or newer), or pip install -e '.[ft]' "
           "in this repository")


def require_torchft():
    """torchft, or an exit with what to install: it is an extra (pyproject's [ft]), not a core dependency."""
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's manager logs every quorum and commit at INFO
    try:
        import torchft
    except ImportError as error:
        sys.exit(f"error: the fault-tolerant rungs need torchft, which this Python cannot import ({error}): {INSTALL}.")
    return torchft


def check_group(args, launch, script: str, one_process: bool = True) -> None:
    """One sentence for a group number out of range, a group of several processes where one is meant, or no
    lighthouse."""
    if not 0 <= args.group < args.groups:
        sys.exit(f"error: --group {args.group} is not one of the {args.groups} groups 0 .. {args.groups - 1}.")
    if one_process and launch.world_size != 1:
        sys.exit(f"error: each replica group of {script} is one process (torchrun --nproc_per_node=1), not "
                 f"{launch.world_size}: start one torchrun per group.")
    if not args.lighthouse:
        sys.exit("error: no lighthouse: start one (torchft_lighthouse --min_replicas 1 --bind '[::]:29510') and pass "
                 "--lighthouse http://HOST:29510, or set TORCHFT_LIGHTHOUSE.")


def run_settings(args, precision: str, training_images: int, max_steps: int) -> dict:
    """What every group of one run shares. A group's state carries them to the peer it heals, which checks
    them (refuse_another_run): a group started with other flags would otherwise take the state and go on."""
    return {"groups": args.groups, "global batch": args.batch_size, "training images": training_images,
            "seed": args.seed, "precision": precision, "steps": max_steps}


def refuse_another_run(peer: dict, ours: dict, group: int) -> None:
    """End this group with one sentence, before it loads anything, where the peer it heals from runs with
    other settings; the live groups go on (they see this one leave the quorum)."""
    if different := another_run(peer, ours):
        print(f"error: group {group} would heal from a group of another run ({different}); start every group "
              "with the same flags.", file=sys.stderr, flush=True)
        exit_process(1)  # now, past torchft's threads: a heal happens inside its step


@contextlib.contextmanager
def quorum_errors():
    """A lighthouse that does not answer, a quorum that does not form in time, or a step whose commit a process
    of the group does not reach in time, as one sentence each. torchft raises the first from the Manager's
    constructor, and the other two as the same gRPC TimeoutError ("Timeout expired"): from the quorum a step
    waits for, or from should_commit, which waits at the group's rank 0 for every rank of the group."""
    try:
        yield
    except RuntimeError as error:
        if "failed to connect" not in str(error):
            raise
        sys.exit(f"error: no lighthouse answered: {str(error).split(';')[0]}. Start it first (torchft_lighthouse "
                 "--min_replicas 1 --bind '[::]:29510'), or pass its address with --lighthouse.")
    except TimeoutError as error:
        if any(frame.name == "should_commit" for frame in traceback.extract_tb(error.__traceback__)):
            sys.exit("error: a step was not committed within --dist-timeout: a process of this group did not reach "
                     "the end of the step in time (stopped, or slowed by a loaded machine); raise --dist-timeout "
                     "where processes share few cores.")
        sys.exit("error: no quorum formed within --quorum-timeout: fewer groups reached the lighthouse than its "
                 "--min_replicas. Start the other groups, or the lighthouse with a smaller --min_replicas.")


def average_gradients(model, manager) -> None:
    """The gradients averaged over the groups in this step's quorum: one all-reduce of one flat buffer, after backward.
    Under FSDP2 each rank averages its own pieces with the same pieces of the other groups (rank r with rank r).

    Not torchft's DistributedDataParallel: at torchft 0.2.0 its gradient hook asserts that every all-reduce returned
    a live future, and one that failed (a peer died during the step) returns none, so the assertion ends the survivor
    too. manager.allreduce records the error instead, and should_commit then says no: the step is taken again."""
    grads = [local_shards(parameter.grad) for parameter in model.parameters()]  # FSDP2: this rank's pieces
    flat = _flatten_dense_tensors(grads)
    manager.allreduce(flat).wait()  # divided by the number of participants; zeros from a group that heals
    for grad, averaged in zip(grads, _unflatten_dense_tensors(flat, grads)):
        grad.copy_(averaged)


def local_shards(state):
    """A state dict with each DTensor (FSDP2's sharded parameters and moments) replaced by this rank's piece: what
    a sharded group sends a healing peer, rank r to rank r, as plain tensors."""
    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {key: local_shards(value) for key, value in state.items()}
    if isinstance(state, list):
        return [local_shards(value) for value in state]
    return state


def sharded_like(received, template):
    """received (local_shards of a peer's state) made DTensors again, each on the mesh and with the placements of
    the matching DTensor of template (this rank's own state); what is not a DTensor there stays as received."""
    if isinstance(template, DTensor):
        return DTensor.from_local(received, template.device_mesh, template.placements, run_check=False,
                                  shape=template.shape, stride=template.stride())
    if isinstance(template, dict):
        return {key: sharded_like(value, template[key]) if key in template else value
                for key, value in received.items()}
    if isinstance(template, list):
        return [sharded_like(value, own) for value, own in zip(received, template)]
    return received


def sharded_optimizer_state(received: dict, parameters: list) -> dict:
    """A peer's optimizer state dict (its local_shards) as this rank's optimizer loads it: each tensor of a
    parameter's state with the shape of that parameter's piece (AdamW's moments) becomes a DTensor like the
    parameter; the rest (the step count, the hyper-parameters) stays as it came."""
    def like(value, parameter):
        return sharded_like(value, parameter) if value.shape == parameter.to_local().shape else value
    state = {index: {key: like(value, parameters[index]) for key, value in moments.items()}
             for index, moments in received["state"].items()}
    return {**received, "state": state}


def timeouts(args) -> dict:
    """The Manager's: the quorum and the lighthouse's connection get --quorum-timeout, a collective --dist-timeout
    (and so does the process group across the groups: a peer killed while the others set it up for a new quorum
    holds them that long)."""
    quorum = timedelta(seconds=args.quorum_timeout)
    return {"timeout": timedelta(seconds=args.dist_timeout), "quorum_timeout": quorum, "connect_timeout": quorum}


class StepBatches:
    """The batch of a step: the data position is the quorum's step, so a group whose step jumps to its peers'
    (a heal) or stays (a step that did not commit) takes the right batch with no loader state to copy. Step k
    is global batch k % E of epoch k // E (E global batches an epoch), cut from a ResumableDistributedSampler."""

    def __init__(self, loader):
        self.loader, self.sampler = loader, loader.sampler
        self.sampler.set_epoch(0)
        self.per_epoch = len(loader)
        self.next_step, self.batches = None, None

    def __call__(self, step: int):
        epoch, batch = divmod(step, self.per_epoch)
        if step != self.next_step or batch == 0:
            self.sampler.set_epoch(epoch, batch * self.sampler.global_batch)
            self.batches = iter(self.loader)
        self.next_step = step + 1
        return next(self.batches)


class StepLog:
    """--step-log's JSON lines and --summary's counts: what the tests check and the figure draws. The file stays open,
    line-buffered, so that each step costs one write (and a reader sees each line as soon as the step ends)."""

    def __init__(self, path: Path | None, group: int, groups: int):
        self.group, self.groups, self.start = group, groups, time.time()
        self.steps_run = self.heals = 0
        self.last = self.fewest = self.most = None  # participants: in the last step, the fewest, the most
        self.file = None
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = path.open("a", buffering=1)

    def step(self, step: int, participants: int, committed: bool, healed: bool) -> bool:
        """Log one step; True where the quorum's size changed or this group healed: what the rung prints."""
        changed = healed or participants != self.last
        self.steps_run += committed
        self.heals += healed
        self.last = participants
        self.fewest = participants if self.fewest is None else min(self.fewest, participants)
        self.most = participants if self.most is None else max(self.most, participants)
        if self.file:
            self.file.write(json.dumps({"time": time.time(), "group": self.group, "step": step,
                                        "participants": participants, "committed": committed, "healed": healed}) + "\n")
        return changed

    def summary(self, path: Path | None, final_step: int, accuracy: float) -> None:
        if self.file:
            self.file.close()
        if path:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({
                "group": self.group, "final_step": final_step, "steps_run": self.steps_run, "heals": self.heals,
                "min_participants": self.fewest or 0, "max_participants": self.most or 0, "accuracy": accuracy,
                "seconds": time.time() - self.start}, indent=1) + "\n")
