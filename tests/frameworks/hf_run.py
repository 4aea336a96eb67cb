"""Transformers' Trainer: 2 CPU ranks over gloo, 2 epochs, a one-layer torch module
(no downloads). With ``--numafast`` the Trainer subclass's ``get_train_dataloader()``
returns ``NumaLoader(super().get_train_dataloader())``.

    torchrun --nproc-per-node 2 tests/frameworks/hf_run.py --out DIR --name NAME [--numafast]

Every other setting is the Trainer's default (``dataloader_pin_memory`` among them),
but the few a test needs: batch 8, 2 workers, 2 epochs, a seed, no reports, no saves.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common  # noqa: E402
import torch  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402


class Epochs(TrainerCallback):
    """Tells the recorder which epoch it is, and takes numafast's stats at each end."""

    def __init__(self, trainer: RecordedTrainer) -> None:
        self.trainer = trainer

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.epoch = round(state.epoch or 0)
        self.trainer.recorder.loader_seen(self.trainer.train_loader)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.recorder.epoch_end(self.trainer.epoch, self.trainer.train_loader, self.trainer.train_loader)


class RecordedTrainer(Trainer):
    recorder: common.Recorder
    epoch = 0
    train_loader: Any = None
    use_numafast = False

    def get_train_dataloader(self) -> Any:
        loader = super().get_train_dataloader()
        # The prepared loader's device placement, on CPU ranks a copy of every batch to
        # cpu:RANK (torch copies between "cpu" and "cpu:0"), with or without numafast, is off
        # in both runs: the step then sees what the loader yields (Trainer._prepare_inputs
        # still moves it to args.device for the model).
        loader.device = None
        if self.use_numafast:
            loader = common.wrap(loader, self.args.process_index)  # the user's one-line change
        self.train_loader = loader
        return loader

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        self.recorder.step(inputs, self.epoch)  # the batch as the training step receives it
        self._received = inputs["x"].data_ptr()
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        # Whether the model got that same memory (Trainer._prepare_inputs moves it to args.device).
        self.recorder.steps[-1]["model_input_same_memory"] = inputs["x"].data_ptr() == self._received
        return super().compute_loss(model, inputs, *args, **kwargs)


def main() -> None:
    args = common.arguments()
    training = TrainingArguments(
        output_dir=os.path.join(args.out, f"{args.name}-output"), per_device_train_batch_size=common.BATCH,
        num_train_epochs=common.EPOCHS, dataloader_num_workers=common.WORKERS, seed=common.SEED, use_cpu=True,
        report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )
    trainer = RecordedTrainer(model=common.Tiny(), args=training, train_dataset=common.Numbered(args.out))
    trainer.use_numafast = args.numafast
    trainer.recorder = common.Recorder(args, training.process_index, training.world_size)
    trainer.add_callback(Epochs(trainer))
    trainer.recorder.notes.append(f"args.device={training.device}, dataloader_pin_memory={training.dataloader_pin_memory}")
    common.run_recorded(trainer.recorder, trainer.train)


if __name__ == "__main__":
    main()
