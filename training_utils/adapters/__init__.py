"""The adapters that train beside a frozen base (LoRA, DoRA, LoKr, LoHa, OFT), and their files.

- `config`: the ``--adapter`` flag and its settings' flags, and peft's config made from them;
- `injection`: which modules of a model an adapter adapts, and adding it there;
- `export`: the trained adapters written where pipelines load them, and checked once written;
- `peft_files`: adapters in peft's own folder format;
- `layouts`, `base_weights`, `convert`: the same adapters in the layouts of the UI tools (kohya's, ComfyUI's);
  ``python -m training_utils.adapters.convert`` converts a run's files after training.
"""
