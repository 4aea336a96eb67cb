"""Accelerate 1.15: 2 CPU ranks over gloo, 2 epochs, a plain training loop.

    torchrun --standalone --nproc-per-node 2 tests/frameworks/accelerate_run.py --out DIR --name NAME \
        [--numafast --variant prepare-wrapped|wrap-prepared]

Without numafast: ``accelerator.prepare(dl)``. With it, the two ways a user adds it:
``prepare-wrapped`` is ``accelerator.prepare(NumaLoader(dl))``, ``wrap-prepared`` is
``NumaLoader(accelerator.prepare(dl))``. FRAMEWORK_NODES="1,2" puts rank r's loader
on the r-th node of the list (``node=``), for the multi-node guest.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402


def main() -> None:
    args = common.arguments()
    # On CPU ranks Accelerate's device placement is a copy of every batch to cpu:RANK (torch
    # copies between "cpu" and "cpu:0"), with or without numafast; on a GPU it is the
    # host-to-device copy, from the pool. Off in both runs, so the step sees what the loader yields.
    accelerator = Accelerator(cpu=True, device_placement=False)
    set_seed(common.SEED)
    rank, world = accelerator.process_index, accelerator.num_processes
    recorder = common.Recorder(args, rank, world)

    def train() -> None:
        model = common.Tiny()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader: Any = common.make_loader(args.out)
        own = None
        if not args.numafast:
            loader = accelerator.prepare(loader)
        elif args.variant == "prepare-wrapped":
            own = common.wrap(loader, rank)
            loader = accelerator.prepare(own)  # the user's one-line change
        elif args.variant == "wrap-prepared":
            loader = own = common.wrap(accelerator.prepare(loader), rank)  # the user's one-line change
        else:
            raise SystemExit(f"--variant {args.variant!r}: prepare-wrapped or wrap-prepared")
        model, optimizer = accelerator.prepare(model, optimizer)
        for epoch in range(common.EPOCHS):
            recorder.loader_seen(loader)
            for batch in loader:
                recorder.step(batch, epoch)
                loss = model(batch["x"])["loss"]
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            recorder.epoch_end(epoch, loader, own)
        accelerator.wait_for_everyone()

    common.run_recorded(recorder, train)
    accelerator.end_training()


if __name__ == "__main__":
    main()
