"""The training loop, checkpoints and logging of `sparserl train`."""

from sparserl.trainer.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from sparserl.trainer.loop import Trainer
from sparserl.trainer.run_dir import find_resumable, new_run_dir, resume_config

__all__ = [
    "Trainer",
    "checkpoint_path",
    "find_resumable",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "new_run_dir",
    "resume_config",
    "save_checkpoint",
]
