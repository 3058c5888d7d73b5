"""A small CNN on scikit-learn's digits (8x8 images, no download) trained
with PyTorch DDP on gloo, its gradients compressed by gradpack's hook:

    torchrun --nproc_per_node 2 examples/torch_ddp.py --compress qsgd_mn --bits 2

Prints the test accuracy, the bytes this rank handed torch.distributed
against a float32 all-reduce of the same gradients, and the time per step.
Any compress_params key can be given as an option (--bits 2,4 --k 1024
--rank 2 --threshold 0.5 --seed 1); --compress none trains uncompressed.
"""
import argparse
import gc
import os
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradpack.torch as gpt

# compress_params' keys that options may set, with their types.
PARAM_KEYS = {"bits": str, "k": int, "rank": int, "threshold": float, "pos_threshold": float,
              "neg_threshold": float, "seed": int, "unselected": str}


class DigitsCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def digits():
    """(train x, train y, test x, test y): the same 80/20 split on every rank."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[order], y[order]
    cut = int(0.8 * len(y))
    return x[:cut], y[:cut], x[cut:], y[cut:]


def train(compress_params, epochs=10, batch=32, lr=0.05, momentum=0.9, start_iter=0, min_compression_rate=2.0,
          data=None, group=None, exchange="lanes", fsdp=False, seed=0):
    """Trains on this rank's shard; returns accuracy, bytes, time per step.
    The loss is summed over the batch and the learning rate given per
    sample (lr / batch), as Gluon's Trainer.step(batch) does: the hook
    sees the summed gradients, the scale 2bit's and 1bit's thresholds and
    codes (+-1) are on. With fsdp, the model is under FSDP2's fully_shard
    (a unit per layer with parameters, then the root) and gradpack in its
    reduce-scatter (gradpack.torch.fsdp.compress) instead of DDP. `seed`
    draws the initial weights and each epoch's order."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    xtr, ytr, xte, yte = data or digits()
    torch.manual_seed(seed)  # the same initial weights on every rank
    model = DigitsCNN()
    state = None
    if fsdp:
        from torch.distributed.fsdp import fully_shard
        import gradpack.torch.fsdp as gpf
        for layer in model.modules():
            if layer is not model and any(True for _ in layer.parameters(recurse=False)):
                fully_shard(layer)
        ddp = fully_shard(model)
        if compress_params is not None:
            state = gpf.compress(model, compress_params, start_iter=start_iter,
                                 min_compression_rate=min_compression_rate)
    else:
        ddp = DDP(model, process_group=group)
        if compress_params is not None:
            state = gpt.State(compress_params, process_group=group, start_iter=start_iter,
                              min_compression_rate=min_compression_rate, exchange=exchange)
            ddp.register_comm_hook(state, gpt.hook)
    opt = torch.optim.SGD(model.parameters(), lr=lr / batch, momentum=momentum)
    mine = torch.arange(rank, len(ytr), world)
    steps, elapsed = 0, 0.0
    for epoch in range(epochs):
        order = mine[torch.randperm(len(mine), generator=torch.Generator().manual_seed(1000 * seed + epoch))]
        for i in range(0, len(order) - batch + 1, batch):
            idx = order[i:i + batch]
            begin = time.perf_counter()
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx], reduction="sum")
            loss.backward()
            opt.step()
            elapsed += time.perf_counter() - begin
            steps += 1
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item()
    stats = state.stats() if state is not None else None
    del ddp, state  # DDP sits in reference cycles: free it before the next model
    gc.collect()
    return {"accuracy": accuracy, "stats": stats, "ms_per_step": 1000 * elapsed / max(1, steps),
            "steps": steps}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compress", default="qsgd_mn")
    for key, kind in PARAM_KEYS.items():
        parser.add_argument("--" + key, type=kind)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--start-iter", type=int, default=0)
    parser.add_argument("--min-compression-rate", type=float, default=2.0)
    parser.add_argument("--local-rank", "--local_rank", type=int, default=0)  # torchrun's, unused on CPU
    args = parser.parse_args()
    params = {"compress": args.compress}
    params.update({k: getattr(args, k) for k in PARAM_KEYS if getattr(args, k) is not None})
    if "RANK" not in os.environ:
        parser.error("start it with torchrun (e.g. torchrun --nproc_per_node 2 %s)" % __file__)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    res = train(params, epochs=args.epochs, start_iter=args.start_iter,
                min_compression_rate=args.min_compression_rate)
    if dist.get_rank() == 0:
        s = res["stats"]
        print("compress_params %s, %d ranks" % (params, dist.get_world_size()))
        print("test accuracy %.2f%% after %d steps" % (100 * res["accuracy"], res["steps"]))
        print("bytes sent %d against %d uncompressed (%.1fx fewer)" % (
            s["bytes_sent"], s["bytes_uncompressed"], s["bytes_uncompressed"] / max(1, s["bytes_sent"])))
        print("%.2f ms per step" % res["ms_per_step"])
    dist.barrier()  # every rank done before any tears down (torch 2.15 on gloo can abort otherwise)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
