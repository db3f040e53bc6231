"""What trains: the data a script reads, from the files people have to the batches of a step.

- `flags`: the data flags every script shares, each declared once;
- `datasets`: datasets (hub name, imagefolder, local files), the data loader, tokenizing;
- `images`, `captions`, `buckets`, `video`: images, captions, aspect-ratio buckets and video clips as training
  reads them, checked before any weights load;
- `dreambooth`, `edit`, `edit_samples`: the data of DreamBooth and of edit models (targets with reference images);
- `frozen_encoders`, `cache_keys`, `feature_store`, `prompts`: the frozen encoders run once (latents and prompt
  embeddings), kept on disk between runs, and a step's text conditioning from them.
"""
