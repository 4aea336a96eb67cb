"""Ray Train 2.60: a local Ray cluster, ``TorchTrainer`` with 2 CPU workers (gloo),
2 epochs; in the train loop ``ray.train.torch.prepare_data_loader(NumaLoader(dl))``
with numafast, ``prepare_data_loader(dl)`` without.

    python3 tests/frameworks/ray_run.py --out DIR --name NAME [--numafast | --variant both]

``--variant both`` runs without numafast, then with it, in the one Ray cluster
(Ray's start is the slow part), writing NAME-without.rank*.json and
NAME-numafast.rank*.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import common  # noqa: E402


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker: a rank."""
    # A Ray worker does not get the driver's PYTHONPATH (which may name the numafast under test).
    for entry in reversed([config["here"], *config["pythonpath"]]):
        sys.path.insert(0, entry)
    import common
    import ray.train
    import ray.train.torch
    import torch

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    args = argparse.Namespace(out=config["out"], name=config["name"], numafast=config["numafast"], variant="")
    recorder = common.Recorder(args, rank, world)

    def body() -> None:
        loader: Any = common.make_loader(args.out)
        own = None
        if args.numafast:
            own = loader = common.wrap(loader, rank)
        loader = ray.train.torch.prepare_data_loader(loader)  # with numafast: prepare_data_loader(NumaLoader(dl))
        model = ray.train.torch.prepare_model(common.Tiny())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for epoch in range(common.EPOCHS):
            # As Ray's guide says: the DistributedSampler it adds reshuffles only when told.
            set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
            if world > 1 and set_epoch is not None:
                set_epoch(epoch)
            recorder.loader_seen(loader)
            for batch in loader:
                recorder.step(batch, epoch)
                loss = model(batch["x"])["loss"]
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            recorder.epoch_end(epoch, loader, own)

    common.run_recorded(recorder, body)


def main() -> None:
    args = common.arguments()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    modes = [("without", False), ("numafast", True)] if args.variant == "both" else [("", args.numafast)]
    # Ray's unix sockets live under its temp dir, whose path must stay short (108 bytes).
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    # Ray gives its raylet a fixed 30 s to register with the GCS (ray/_private/node.py);
    # on a loaded 2-core machine that has run out once: start the local cluster again.
    for attempt in range(3):
        try:
            ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp, log_to_driver=True)
            break
        except Exception as error:  # Ray raises a bare Exception for this timeout
            if "timed out during startup" not in str(error) or attempt == 2:
                raise
            print(f"ray_run: {error}; starting the cluster again", file=sys.stderr, flush=True)
            ray.shutdown()
    failed = []
    try:
        for suffix, numafast in modes:
            name = f"{args.name}-{suffix}" if suffix else args.name
            trainer = TorchTrainer(
                train_loop,
                train_loop_config={"here": HERE, "out": args.out, "name": name, "numafast": numafast,
                                   "pythonpath": [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]},
                scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                run_config=RunConfig(name=name, storage_path=os.path.join(args.out, "ray_results")),
            )
            try:
                trainer.fit()
            except Exception as error:  # noqa: BLE001  (each rank wrote its own error)
                print(f"ray_run: {name}: {type(error).__name__}: {error}", file=sys.stderr)
                failed.append(name)
    finally:
        ray.shutdown()
        shutil.rmtree(temp, ignore_errors=True)
    if failed:
        raise SystemExit(f"ray_run: failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
