"""One run of an entry point (`recipes/train.py`, `recipes/sft.py`): the parsed recipe, its run folder (one for all
ranks), resuming from the folder's last complete checkpoint, the run's record, and leaving together at the end.

Nothing here trains: the trainers are TRL's (vision_grpo/training/trainer.py adds what vision-language GRPO needs).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from accelerate import PartialState
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from trl import ModelConfig

from vision_grpo.data.reading import found_when_read
from vision_grpo.models.embedded import EMBEDDED_MODELS
from vision_grpo.recipe.arguments import RecipeError, TaskArguments
from vision_grpo.recipe.parse import parse_recipe, recipe_path_of
from vision_grpo.run.checksums import CheckpointChecksums
from vision_grpo.run.locks_and_digests import hold_lock
from vision_grpo.run.manifest import (
    START_FILES,
    code_identity,
    dataset_identity,
    model_identity,
    read_manifest,
    run_folder_fault,
    write_run_end,
    write_run_start,
)
from vision_grpo.run.rank_watch import RankWatch, watch_ranks
from vision_grpo.run.ranks import decided_by_main_process, from_main_process
from vision_grpo.run.resume import (
    EndAtMaxSteps,
    NothingLeftToTrain,
    RunConflict,
    check_resume,
    checkpoint_fault,
    finished_step,
    resume_checkpoint,
)
from vision_grpo.run.threads import configure_threads
from vision_grpo.storage.writes import is_temporary_of, naming_a_full_disk

logger = logging.getLogger(__name__)


class NothingTrained(RuntimeError):
    """A run that ended without one optimizer step: an exit status that is not 0 and no weights that look trained."""


@dataclass
class RecipeRun:
    """One run of an entry point: the parsed recipe, its run folder, the checkpoint to resume, the process's role.

    `recipes/train.py` and `recipes/sft.py` share it, so both record their runs and resume the same way.
    """

    task_args: TaskArguments
    training_args: Any
    model_args: Any
    argv: list[str]
    recipe_path: str | None
    run_dir: Path
    resume_from: str | None
    is_main: bool
    finished: bool = False
    model_weights: dict[str, Any] | None = None  # the model by content (main process): checked on resume, recorded
    lock: ExitStack = field(default_factory=ExitStack)  # the run folder's lock (main process), held until `close`
    watch: RankWatch | None = None  # this rank's heartbeat and its watch on the others (several processes)

    @classmethod
    def start(cls, trainer_config_cls: type, argv: list[str]) -> RecipeRun:
        """Parse the recipe (fails on any bad key before loading anything) and set up the run folder.

        A run folder is one run's: a fresh start in a folder that holds files is refused (unless `overwrite_run`,
        which deletes them first), and a resume that would compute anything differently from the run it continues
        is refused listing the differences (unless `resume_allow_changes` names them); a refused run changes
        nothing. A resumed run that already reached its `max_steps` is `finished`: the entry point then stops
        without loading anything or touching the folder. With a larger `max_steps` it continues from its last
        checkpoint.
        """
        if recipe_path_of(argv) is None and not {"--help", "-h", "--help_all"} & set(argv):
            raise RecipeError(  # TRL's defaults alone fail far from the cause ("Your setup doesn't support bf16/gpu")
                "no recipe: pass `--config <recipe.yaml>`, e.g. `--config recipes/shapes/tiny_cpu.yaml` (the recipes "
                "are in recipes/; keys on the command line override the recipe's)"
            )
        configs = parse_recipe((TaskArguments, trainer_config_cls, ModelConfig), argv)
        task_args, training_args, model_args = configs
        configure_threads()
        # Parsing set up the process group: from here on a rank that stalls is named, even in the broadcasts below.
        watch = watch_ranks(task_args.rank_stall_timeout)
        recipe_path = recipe_path_of(argv)
        output_dir = Path(training_args.output_dir)
        run_dir = prepare_run_dir(training_args, Path(recipe_path).stem if recipe_path else "cli")
        is_main = PartialState().is_main_process
        run = cls(task_args, training_args, model_args, argv, recipe_path, run_dir, None, is_main, watch=watch)

        def claim() -> None:
            check_local_model_path(model_args.model_name_or_path)
            run.lock.enter_context(hold_run_dir(run_dir))
            run.resume_from = resume_checkpoint(training_args.resume_from_checkpoint, run_dir)
            if run.resume_from is None:
                claim_run_dir(run_dir, output_dir, task_args.overwrite_run)
            run.model_weights = model_identity(model_args.model_name_or_path, model_args.model_revision)
            if run.resume_from is not None:
                check_resume(run.resume_from, recipe_path, argv, configs, run.model_weights)

        try:
            decided_by_main_process(claim)
        except BaseException:
            run.lock.close()
            raise
        resume_from = run.resume_from = from_main_process(run.resume_from)
        if resume_from is not None:
            step = finished_step(run_dir, training_args.max_steps, training_args.num_train_epochs)
            if step is not None:
                logger.warning(
                    "run %s already finished at step %d (max_steps %s): nothing to do, nothing changed; raise "
                    "max_steps to continue it",
                    run_dir,
                    step,
                    training_args.max_steps,
                )
                run.finished = True
        return run

    def __enter__(self) -> RecipeRun:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Release the run folder's lock however the run ended (a failure before training leaves no trace)."""
        self.lock.close()
        self.stop_watch()

    def train_and_save(
        self, trainer: Any, processor: Any, rows_unused: Mapping[str, Mapping[str, int]] | None = None
    ) -> Path:
        """Record the run (with `rows_unused`: by split, the source's rows its task left out, by reason), train
        (resuming if asked), save the model or adapter and the processor, close the record."""
        if self.is_main:
            facts = {
                "task": self.task_args.task,
                "trainer": type(trainer).__name__,  # which kind of run this is, known before anything is logged
                "dataset": dataset_identity(self.task_args),
                "code": code_identity(self.task_args),  # the task's and rewards' files: a resume compares them
                "model_weights": self.model_weights,
                "seed": self.training_args.seed,
                "resumed_from": self.resume_from,  # None for a fresh start
                "rows_unused": {split: dict(reasons) for split, reasons in (rows_unused or {}).items() if reasons},
            }
            configs = (self.task_args, self.training_args, self.model_args)
            write_run_start(self.run_dir, self.recipe_path, self.argv, configs, **facts)
        trainer.add_callback(CheckpointChecksums())
        trainer.add_callback(EndAtMaxSteps())
        try:
            trainer.train(resume_from_checkpoint=self.resume_from)
        except NothingLeftToTrain:
            logger.info(
                "%s is at step %d of %d: nothing left to train; saving the final weights and the end record",
                self.resume_from,
                trainer.state.global_step,
                trainer.state.max_steps,
            )
            trainer.control = trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
        if trainer.state.global_step == 0:
            raise NothingTrained(
                f"{self.run_dir}: training ended at step 0, no update was made (an epoch without a full batch, or a "
                "stop before the first step); nothing saved. The run's logs stay in the folder"
            )
        # A full disk here is named; the run has no end record yet, so the same command with
        # `--resume_from_checkpoint last` loads the last checkpoint and saves the final weights again.
        trainable = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad)
        with naming_a_full_disk(self.run_dir, trainable):
            trainer.save_model(str(self.run_dir))
        if self.is_main:
            processor.save_pretrained(str(self.run_dir))
            write_run_end(
                self.run_dir,
                global_step=trainer.state.global_step,
                max_steps=trainer.state.max_steps,
                num_train_epochs=self.training_args.num_train_epochs,
                # reward_faults: skip, in this launch (SFT has no rewards)
                skipped_completions=getattr(trainer, "skipped_completions", None),
                skipped_steps=getattr(trainer, "skipped_steps", None),  # every completion skipped: no update
                # dynamic_sampling_rounds: prompts drawn beyond the plain schedule, in this launch
                extra_prompts=getattr(trainer, "extra_prompts", None),
                # skip_bad_rows: training rows whose image did not decode when read, replaced by the next row
                rows_skipped_when_read=found_when_read(trainer.train_dataset),
            )
        return self.close()

    def close(self) -> Path:
        """Leave together and close the process group: no rank leaves while another still waits in a collective.
        The worker's exit itself is `launched.finish`'s (gloo's threads can abort an interpreter's finalisation)."""
        state = PartialState()
        state.wait_for_everyone()
        self.stop_watch()  # every rank is past its last collective: one that leaves first has not stalled
        state.destroy_process_group()
        self.lock.close()
        return self.run_dir

    def stop_watch(self) -> None:
        if self.watch is not None:
            self.watch.stop()


def check_local_model_path(name: str) -> None:
    """A model name that cannot be a Hub id (`name` or `owner/name`) is a local folder: say it is missing, instead
    of the Hub client's "Repo id must be in the form ..." (HFValidationError)."""
    if name in EMBEDDED_MODELS or Path(name).expanduser().exists():
        return
    if name.count("/") > 1 or ".." in Path(name).parts or "\\" in name:
        raise FileNotFoundError(
            f"model path {name} does not exist (a Hub id is `name` or `owner/name`, so this must be a local folder)"
        )


def hold_run_dir(run_dir: Path) -> ExitStack:
    """The run folder's lock, `.<run name>.lock` beside it (so it outlives deleting the folder), held until the
    returned stack closes; the folders made to hold it are removed then if nothing else was written into them."""

    def busy(holder: str) -> RunConflict:
        return RunConflict(
            f"run folder {run_dir} is in use by another run (pid {holder}): wait for it to end, or choose another "
            "--run_name"
        )

    stack = ExitStack()
    made = [folder for folder in [run_dir.parent, *run_dir.parent.parents] if not folder.exists()]
    for folder in made:  # innermost first: removed in this order, each only if empty
        stack.callback(lambda folder=folder: folder.is_dir() and not any(folder.iterdir()) and folder.rmdir())
    stack.enter_context(hold_lock(run_dir.with_name(f".{run_dir.name}.lock"), busy))
    return stack


def claim_run_dir(run_dir: Path, output_dir: Path, overwrite: bool) -> None:
    """A fresh run's folder must be empty: an earlier run's checkpoints and events would be mixed with this one's,
    and a later `resume_from_checkpoint last` would continue the earlier run. `overwrite` deletes them instead, but
    only from a folder that is provably one of our runs inside `output_dir` (`run_folder_fault`); a run of ours that
    stopped before its first checkpoint has nothing to resume: its files are moved aside (`<run>.stopped-<time>`) and
    the folder taken over. Called with the run
    folder's lock held: no other run is using it.
    """
    entries = list(run_dir.iterdir()) if run_dir.is_dir() else []
    leftovers = [path for path in entries if any(is_temporary_of(path, run_dir / name) for name in START_FILES)]
    if leftovers and len(leftovers) == len(entries):  # a start killed before its manifest was renamed into place
        logger.warning(
            "run folder %s holds only the temporary files of a start that was stopped: removing %s",
            run_dir,
            ", ".join(sorted(path.name for path in leftovers)),
        )
        for path in leftovers:
            path.unlink()
    held = sorted(path.name for path in run_dir.iterdir()) if run_dir.is_dir() else []
    if not held:
        return
    fault = run_folder_fault(run_dir, output_dir)
    if overwrite:
        if fault:
            raise RunConflict(
                f"overwrite_run: will not delete {run_dir}: {fault}. Only a run folder of ours (with its "
                "manifest.json) inside output_dir is ever deleted; choose another --run_name or --output_dir"
            )
        logger.warning("overwrite_run: deleting the earlier run in %s (%s)", run_dir, ", ".join(held))
        shutil.rmtree(run_dir)
    elif fault is None and stopped_before_first_checkpoint(run_dir):
        aside = run_dir.with_name(f"{run_dir.name}.stopped-{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}")
        run_dir.rename(aside)  # its logs and events may say why it stopped: kept, beside the runs TensorBoard shows
        logger.warning(
            "run folder %s holds a run that stopped before its first checkpoint (nothing to resume): starting over "
            "in it; the earlier start's files (%s) are moved to %s",
            run_dir,
            ", ".join(held),
            aside,
        )
    else:
        shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
        raise RunConflict(
            f"run folder {run_dir} already holds a run ({shown}): pass --resume_from_checkpoint last to continue it, "
            "--overwrite_run true to delete it and start over, or choose another --run_name"
        )


# What a run leaves that is worth keeping: its checkpoints and, at its end, its final weights.
FINAL_WEIGHTS = ("adapter_model.safetensors", "model.safetensors", "model.safetensors.index.json")


def stopped_before_first_checkpoint(run_dir: Path) -> bool:
    """A run of ours that never ended, left no complete checkpoint and no final weights: there is nothing in it to
    resume. A checkpoint that `resume_from_checkpoint last` would skip (killed while saving, before its checksums)
    counts as none: otherwise neither a resume nor the same command could continue such a run."""
    manifest = read_manifest(run_dir) or {}
    return (
        manifest.get("ended") is None
        and all(checkpoint_fault(folder) for folder in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*"))
        and not any((run_dir / name).exists() for name in FINAL_WEIGHTS)
    )


def prepare_run_dir(trainer_args: Any, recipe_name: str) -> Path:
    """Point the trainer at `runs/<task>/<recipe>/<run-name>/`: checkpoints, TensorBoard events, resolved recipe.

    The recipe's `output_dir` is the recipe's folder; the run name comes from `run_name` (recipe or `--run_name`)
    or the start time on the main process, which every process takes (ranks whose clocks straddle a second would
    otherwise write into two folders). Rerunning with the same `run_name` finds that run's checkpoints again.
    """
    run_name = trainer_args.run_name or from_main_process(datetime.now().strftime("%Y%m%d-%H%M%S"))
    if Path(run_name).is_absolute() or ".." in Path(run_name).parts or not Path(run_name).parts:
        raise RecipeError(
            f"run_name {run_name!r} must name a folder inside output_dir (no absolute path, no `..`); set "
            "`output_dir` to choose where runs go"
        )
    output_dir = Path(trainer_args.output_dir)
    for folder in [output_dir, *output_dir.parents]:  # a file on the way: the folders cannot be made
        if folder.exists() and not folder.is_dir():
            raise RecipeError(f"output_dir {output_dir}: {folder} is a file, not a folder; set output_dir to a folder")
    run_dir = output_dir / run_name
    trainer_args.output_dir = str(run_dir)
    trainer_args.run_name = run_name
    # transformers 5 reads TensorBoard's folder from this variable only (`logging_dir` is gone).
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_dir)
    logger.info("run %s of recipe %s in %s", run_name, recipe_name, run_dir)
    return run_dir
