"""What a run leaves in its output folder, and how the run ends.

- `folder`: the output folder, guarded against writing over another run's outputs;
- `writing`, `export`, `pipeline_folder`: outputs written atomically and checked once written (model folders, a full
  fine-tune's pipeline folder with its untrained models' files linked; adapters are
  `training_utils.adapters.export`'s);
- `checkpointing`, `checkpoint_folders`, `manifest`: checkpoints that resume exactly and verify themselves;
- `hub`: the model card, the upload, and where everything went;
- `run_status`, `stop_signals`: how the run ended (``run_status.json``, the exit status), whatever ended it.
"""
