"""A small, unmodified PyTorch training loop: what `gpushare run` gates.

Runs on the CPU where there is no GPU (PyTorch's CPU build is enough), on the GPU where
there is one. Nothing in it knows gpushare: under `gpushare run -- python train.py` each
forward pass and optimizer step waits for the lease, and yields it when its quantum ends.
"""

from __future__ import annotations

import argparse
import time

import torch

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=600)
ap.add_argument("--step-seconds", type=float, default=0.05, help="a bigger model's step time")
args = ap.parse_args()

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
model = torch.nn.Sequential(
    torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)
).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(256, 64, device=device)
y = x.sum(dim=1, keepdim=True)
t0 = time.monotonic()
for step in range(args.steps + 1):
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    time.sleep(args.step_seconds)
    if step % 100 == 0:
        print(f"step {step} loss {loss.item():.4f} ({time.monotonic() - t0:.1f} s)", flush=True)
