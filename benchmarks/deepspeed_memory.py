"""Memory per rank under DeepSpeed's ZeRO stages 0-3, beside planner.plan and DeepSpeed's own estimators.

It starts N gloo processes on this machine and trains a BERT sequence classifier (from the --model
folder's config, random weights) for --steps steps under a DeepSpeed engine at each stage in turn, in
bf16 (the engine's 16-bit weights with fp32 masters: what the estimators and the plan's "mixed"
assume) or --precision fp32. Rank 0 reports what the engine holds, by storage, each counted once:
  - parameters: the module's parameters as they are between steps (ZeRO-3: each one's own piece,
    p.ds_tensor, plus those it keeps whole, under stage3_param_persistence_threshold elements);
  - gradients: every tensor storage alive right after the last engine.backward() (the activations are
    freed by then), found by walking the garbage collector's objects, less the parameters, the
    optimizer's, the module's buffers and the batch: the gradients and the engine's buffers for
    them (ZeRO-2's and 3's reduce buckets among them), wherever the engine keeps them;
  - optimizer: AdamW's state and the fp32 masters the engine steps (ZeRO's flat partitions).
Beside them: planner.plan.memory_bytes for the same stage, Ψ and N, and DeepSpeed's estimators
(estimate_zero2_model_states_mem_needs for stage 2, estimate_zero3_model_states_mem_needs for stage 3,
without offload, with the largest layer counted as DeepSpeed's own *_all_live does: the module with
the most parameters of its own, here the word embeddings; DeepSpeed has none for stages 0 and 1).
Sizes in MiB (2**20 bytes).

    python benchmarks/deepspeed_memory.py --model path/to/bert --world-size 3
"""
import argparse
import gc
import json
import warnings

import torch
import torch.nn.functional as F

from common.memory import optimizer_tensors, storage_bytes
from common.spawn import run_in_process_group
from planner.plan import memory_bytes

MiB = 2**20
PLAN = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}


def live_tensors() -> list[torch.Tensor]:
    gc.collect()
    with warnings.catch_warnings():  # isinstance on some of the objects warns of deprecated modules
        warnings.simplefilter("ignore")
        return [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]


def ids(tensors) -> set:
    return {tensor.untyped_storage()._cdata for tensor in tensors}


def held(rank, world_size, model_folder, stage, precision, steps):
    """What rank `rank`'s engine holds at `stage`, in bytes, and the model's sizes."""
    import deepspeed
    from transformers import AutoConfig, AutoModelForSequenceClassification
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(model_folder, num_labels=3))
    params = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in module.parameters(recurse=False)) for module in model.modules())  # as DeepSpeed's model_to_params
    config = {"train_batch_size": 4 * world_size, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-5), config=config)
    tokens = torch.randint(0, model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(rank))
    labels = torch.randint(0, 3, (4,))
    for _ in range(steps):
        engine.backward(F.cross_entropy(engine(input_ids=tokens).logits.float(), labels))
        after_backward = live_tensors()
        engine.step()
    module_params = [p.ds_tensor if hasattr(p, "ds_tensor") else p for p in engine.module.parameters()]
    module_params += [p for p in engine.module.parameters() if hasattr(p, "ds_tensor") and p.numel()]  # kept whole
    base = engine.optimizer.optimizer if hasattr(engine.optimizer, "optimizer") else engine.optimizer
    masters = [p for group in base.param_groups for p in group["params"]]  # ZeRO-1/2's flat fp32 partitions
    masters += getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])  # ZeRO-3 lends them to AdamW per step only
    in_module = ids(module_params)
    optimizer = optimizer_tensors(base) + [p for p in masters if p.untyped_storage()._cdata not in in_module]
    others = ids([*module_params, *optimizer, *engine.module.buffers(), tokens, labels])
    gradients = storage_bytes(t for t in after_backward if t.untyped_storage()._cdata not in others)
    return {"params": params, "largest_layer": largest, "parameters": storage_bytes(module_params),
            "gradients": gradients, "optimizer": storage_bytes(optimizer)}


def estimates(stage, params, largest, world_size):
    """DeepSpeed's estimate of GPU bytes per rank for the model states, without offload; None where it has none."""
    if stage == 2:
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
        return estimate_zero2_model_states_mem_needs(params, num_gpus_per_node=world_size, cpu_offload=False)[1]
    if stage == 3:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        return estimate_zero3_model_states_mem_needs(params, largest, num_gpus_per_node=world_size, cpu_offload=False,
                                                     cpu_offload_params=False)[1]
    return None


def every_stage(rank, world_size, model_folder, precision, steps):
    return {stage: held(rank, world_size, model_folder, stage, precision, steps) for stage in (0, 1, 2, 3)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a folder with a BERT-family config.json")
    parser.add_argument("--world-size", type=int, default=3)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    results = run_in_process_group(every_stage, args.world_size, args.model, args.precision, args.steps, timeout=600)
    params = results[0]["params"]
    plan_precision = "mixed" if args.precision == "bf16" else "fp32"
    print(f"DeepSpeed ZeRO, {args.world_size} processes, {args.precision}: Ψ = {params:,} parameters; "
          f"per rank, MiB (plan: planner.plan {plan_precision})")
    print(f"{'stage':>5} | {'params':>7} {'(plan)':>7} | {'grads':>7} {'(plan)':>7} | {'optim':>7} {'(plan)':>7} | "
          f"{'total':>7} {'(plan)':>7} | {'DeepSpeed estimate':>18}")
    rows = []
    for stage, measured in results.items():
        plan = memory_bytes(PLAN[stage], params, args.world_size, plan_precision)
        estimate = estimates(stage, params, measured["largest_layer"], args.world_size)
        held_bytes = (measured["parameters"], measured["gradients"], measured["optimizer"])
        cells = " | ".join(f"{m / MiB:7.2f} {f'({p / MiB:.2f})':>7}" for m, p in zip((*held_bytes, sum(held_bytes)), (*plan, sum(plan))))
        print(f"{stage:>5} | {cells} | {'none' if estimate is None else f'{estimate / MiB:.2f}':>18}")
        rows.append({"stage": stage, "held": held_bytes, "plan": plan, "estimate": estimate})
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"params": params, "world_size": args.world_size, "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
