"""A `Validator` run on the tiny SD pipeline (raw and EMA, three prompts, two validations), on however many
processes ``accelerate launch`` starts; each process also writes which prompts it rendered.

    accelerate launch [--multi_gpu --num_processes 2] tests/parallel_validation_job.py TINY_SD OUTPUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from diffusers import StableDiffusionPipeline

from training_utils.ema import EMA
from training_utils.validation import Validator

PROMPTS = ["a red circle", "a blue square", "a green triangle"]


def main(model, output_dir):
    accelerator = Accelerator()
    pipe = StableDiffusionPipeline.from_pretrained(model).to(accelerator.device)
    pipe.set_progress_bar_config(disable=True)
    parameters = dict(pipe.unet.conv_out.named_parameters())
    ema = EMA(parameters, decay=0.9)
    with torch.no_grad():  # the raw weights move away from the EMA's, so the two variants differ
        for parameter in parameters.values():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(1)) * 0.5)

    rendered = []
    encode_prompt = pipe.encode_prompt

    def recording_encode_prompt(prompt, *args, **kwargs):
        rendered.append(prompt)
        return encode_prompt(prompt, *args, **kwargs)

    pipe.encode_prompt = recording_encode_prompt
    validator = Validator(pipe, accelerator, output_dir, PROMPTS, num_images=2, num_inference_steps=2, seed=0,
                          ema=ema, call_kwargs={"height": 32, "width": 32})
    for step in (1, 2):
        records = validator(step, final=step == 2)
        if accelerator.is_main_process:
            assert [record["step"] for record in records] == [step] * 2 * len(PROMPTS), records
    Path(output_dir, f"rendered-{accelerator.process_index}.json").write_text(json.dumps(rendered))
    accelerator.end_training()


if __name__ == "__main__":
    main(*sys.argv[1:])
