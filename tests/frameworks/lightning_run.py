"""Lightning 2.6: 2 CPU ranks, DDP over gloo, 2 epochs; ``train_dataloader()`` returns
``NumaLoader(DataLoader(ds, batch_size=8, shuffle=True, num_workers=2))`` with
``--numafast``, the DataLoader itself without.

    python3 tests/frameworks/lightning_run.py --out DIR --name NAME [--numafast] [--variant reload]

Started once: Lightning's own launcher (``strategy="ddp"``) runs this script again
for rank 1, with the same arguments. ``--variant reload`` sets
``reload_dataloaders_every_n_epochs=1``. ``--variant fork`` is a notebook user's run:
the loader is made (and wrapped) before ``trainer.fit``, its first batch peeked at
with ``next(iter(loader))``, and ``strategy="ddp_fork"`` forks the two ranks, which
inherit it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import lightning as L  # noqa: E402
import torch  # noqa: E402


class Module(L.LightningModule):
    def __init__(self, args: Any) -> None:
        super().__init__()
        self.args = args
        self.model = common.Tiny()
        self.recorder: common.Recorder | None = None
        self.own: Any = None
        self.made_before: Any = None  # --variant fork: the loader made, and peeked at, before the ranks

    def setup(self, stage: str) -> None:
        self.recorder = common.Recorder(self.args, self.global_rank, self.trainer.world_size)

    def train_dataloader(self) -> Any:
        if self.made_before is not None:
            self.own = self.made_before
            return self.made_before
        loader = common.make_loader(self.args.out)
        if self.args.numafast:
            loader = common.wrap(loader, self.global_rank)  # the user's one-line change
        self.own = loader
        return loader

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        assert self.recorder is not None
        self.recorder.step(batch, self.current_epoch)
        return self.model(batch["x"])["loss"]

    def on_train_epoch_start(self) -> None:
        assert self.recorder is not None
        self.recorder.loader_seen(self.trainer.train_dataloader)

    def on_train_epoch_end(self) -> None:
        assert self.recorder is not None
        self.recorder.epoch_end(self.current_epoch, self.trainer.train_dataloader, self.own)

    def on_train_end(self) -> None:
        if self.args.variant == "fork":  # a forked rank ends without returning to main()
            assert self.recorder is not None
            self.recorder.write()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    args = common.arguments()
    L.seed_everything(common.SEED, verbose=False)
    module = Module(args)
    if args.variant == "fork":
        loader = common.make_loader(args.out)
        module.made_before = common.wrap(loader, 0) if args.numafast else loader
        next(iter(module.made_before))  # a look at the first batch, before the ranks are forked
    trainer = L.Trainer(
        strategy="ddp_fork" if args.variant == "fork" else "ddp", devices=2, accelerator="cpu", max_epochs=common.EPOCHS,
        reload_dataloaders_every_n_epochs=1 if args.variant == "reload" else 0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=args.out,
    )
    try:
        trainer.fit(module)
    except BaseException:
        if module.recorder is not None:
            import traceback

            module.recorder.write(error=traceback.format_exc())
        raise
    if args.variant == "fork":
        return  # the parent of the forked ranks, which wrote their records (on_train_end)
    assert module.recorder is not None
    module.recorder.write()


if __name__ == "__main__":
    main()
