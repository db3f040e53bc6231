"""`training_utils.sharding.text_encoders` on the tiny FLUX.2 [klein]'s Qwen3 text encoder, on the processes
``accelerate launch`` starts with FSDP2 asked for; each process writes what it saw to ``OUTPUT_DIR/process-<rank>.json``
for `test_text_encoder_sharding` to check.

    ACCELERATE_USE_FSDP=true FSDP_VERSION=2 accelerate launch --num_processes 2 --cpu \\
        tests/text_encoder_sharding_job.py TINY_FLUX2_KLEIN OUTPUT_DIR

Before sharding, the prompts are embedded whole; then sharded, three times: one caption a chunk (three chunks: one
process encodes two, the other one and a call to keep in step), into a feature cache, and from that cache (no
encoder runs). Every forward of the encoder is counted. Then uneven plans straight through `in_lockstep` (process 0
none, the others two calls), and class images generated with the sharded encoder (and, before, whole).
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from diffusers import Flux2KleinPipeline

from training_utils.data.cache_keys import describe
from training_utils.data.dreambooth import generate_class_images
from training_utils.data.frozen_encoders import FrozenEncoders
from training_utils.sharding.fsdp2 import enable_fsdp2_on_cpu, fsdp2_plugin, held_bytes, sharded_units, whole_bytes
from training_utils.sharding.text_encoders import in_lockstep, shard_text_encoders

CAPTIONS = ["a photo of sks triangle", "a red square", "a green circle on a blue sky"]


def render_class_images(pipe, accelerator, class_dir):
    return generate_class_images(pipe, "a triangle", class_dir, 2, accelerator, seed=0, batch_size=1,
                                 num_inference_steps=2, call_kwargs={"height": 32, "width": 32,
                                                                     "max_sequence_length": 32})


def main(model, output_dir):
    plugin = fsdp2_plugin()
    accelerator = Accelerator(fsdp_plugin=plugin)
    enable_fsdp2_on_cpu(accelerator, plugin)
    pipe = Flux2KleinPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    encoder = pipe.text_encoder.requires_grad_(False)
    calls = []
    encoder.register_forward_pre_hook(lambda module, inputs: calls.append(module))

    def encode(prompts):
        return pipe.encode_prompt(prompts, device=accelerator.device, max_sequence_length=32)

    def embeddings(cache_dir=None):
        frozen = FrozenEncoders(None, [encoder], None, accelerator.device, torch.float32, cache_dir=cache_dir,
                                batch_size=1)
        return frozen.text_embeddings(CAPTIONS, encode)

    def equal(found):
        return all(torch.equal(part, expected_part) for caption in CAPTIONS
                   for part, expected_part in zip(found[caption], whole[caption], strict=True))

    whole = embeddings()
    render_class_images(pipe, accelerator, Path(output_dir) / "class_whole")
    described = describe(encoder)
    unsharded_bytes = whole_bytes({"text_encoder": encoder})["frozen"]
    shard_text_encoders(accelerator, [encoder], True)
    report = {"held": held_bytes({"text_encoder": encoder})["frozen"], "whole": unsharded_bytes,
              "units": sharded_units({"text_encoder": encoder}), "layers": encoder.config.num_hidden_layers,
              "described_as_whole": describe(encoder) == described}
    calls.clear()
    report["equal"] = equal(embeddings())
    report["calls"] = len(calls)
    cache = Path(output_dir) / "cache"
    calls.clear()
    report["equal_cached"] = equal(embeddings(cache))
    report["calls_cached"] = len(calls)
    calls.clear()
    report["equal_reused"] = equal(embeddings(cache))
    report["calls_reused"] = len(calls)

    plan = [] if accelerator.is_main_process else CAPTIONS[1:]
    calls.clear()
    with torch.no_grad():
        rows = list(in_lockstep(plan, lambda caption: encode([caption])[0], lambda: encode(CAPTIONS[:1])))
    report["lockstep_calls"] = len(calls)
    report["lockstep_equal"] = all(torch.equal(row[0], whole[caption][0]) for row, caption in zip(rows, plan))

    calls.clear()
    report["class_images"] = render_class_images(pipe, accelerator, Path(output_dir) / "class")
    report["class_calls"] = len(calls)
    Path(output_dir, f"process-{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
