"""A small DDP job (gloo, the CPU build of PyTorch) for gangs' checks: each rank trains
the same model on data of its own, and writes its final parameters, its training time
and its session's figures to ``OUT/rank<r>.json`` (a file each: the ranks share stdout).

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_job.py OUT STEPS

Under ``gpushare run`` its steps are gated by the run's hooks; with ``DDP_ATTACH=1`` it
attaches itself (``gpushare.attach``, rank r on GPU r) and holds the GPU around each
step; bare (no gpushare) it is the reference the others' results must equal. With
``DDP_START_FILE`` it trains once that file exists (jobs started side by side under load
then overlap: each would take turns with the other, not run alone).
"""

import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gpushare.client import runner

dist.init_process_group("gloo")
rank = dist.get_rank()
burst, s = contextlib.nullcontext, runner.SESSION  # under gpushare run: its hooks gate
if os.environ.get("DDP_ATTACH"):
    import gpushare

    s = gpushare.attach(memory="2GiB", gpu=int(os.environ["LOCAL_RANK"]))
    burst = s.gpu
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
if os.environ.get("DDP_START_FILE"):  # jobs run side by side start together (tests)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.environ["DDP_START_FILE"]) and time.monotonic() < deadline:
        time.sleep(0.01)
t0, start = time.monotonic(), time.time()
for _ in range(int(sys.argv[2])):
    with burst():
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
        loss = ((ddp(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()  # the all-reduce: every rank of the job at once
        opt.step()
    time.sleep(0.005)
out = {
    "params": [p.detach().flatten().tolist() for p in model.parameters()],
    "seconds": time.monotonic() - t0,
    "start": start,  # wall clock: the spans of jobs run side by side
    "end": time.time(),
}
if s is not None:  # (none in the bare run)
    out["session"], out["grants"] = s.id, s.grants
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
