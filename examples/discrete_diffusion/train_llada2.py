#!/usr/bin/env python
# Copied from examples/amused/train_amused.py; tests/test_drift.py keeps what they share alike.
"""Fine-tune a causal LM into a LLaDA2-style masked text diffusion model (every parameter), with an optional EMA.

    accelerate launch train_llada2.py \\
      --model_name_or_path=Qwen/Qwen2.5-0.5B --dataset_name=wikitext --dataset_config_name=wikitext-2-raw-v1 \\
      --text_column=text --output_dir=llada2-output --max_train_steps=1000 --prompt_length=32 --block_length=32 \\
      --use_ema --validation_prompt "Once upon a time" --validation_steps=100

The model is a causal LM that transformers has built in, with its tokenizer (a mask token added where it has none,
the embeddings resized), from one folder or hub id; code from the hub (trust_remote_code) is refused. Each text
(``--text_column``, its first ``--max_length`` tokens; or ``--use_dummy_data``'s random tokens) keeps its first
``--prompt_length`` tokens; the rest is masked block by block (``--block_length``) at random rates, and the model
learns the masked tokens back in that view and in the complementary one, with upstream's confidence-aware loss
(``--lambda_conf``, ``--conf_temperature``; `training_utils.llada2`). Writes the trained model with its tokenizer
to ``output_dir`` (``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` load it, and
``LLaDA2Pipeline`` renders with them) and, with ``--use_ema``, the EMA model to ``output_dir/ema``; validation texts
rendered by ``LLaDA2Pipeline`` from the live model (``validation/step-NNNNNN/*.txt`` and ``validation/log.jsonl``),
checkpoints to resume from, and a model card.
"""

import training_utils  # noqa: F401  (first: filters what diffusers' imports log; training_utils.console)

import torch
from diffusers import BlockRefinementScheduler, LLaDA2Pipeline

from training_utils import llada2
from training_utils.accelerator import end_training, make_accelerator, prepare_trained, tracker_config
from training_utils.args import check_args, fill_dependent_defaults, training_parser
from training_utils.compile import compile_repeated_blocks
from training_utils.data.datasets import TrainDataset, load_train_dataset, make_dataloader
from training_utils.ema import make_ema
from training_utils.errors import require
from training_utils.loop import TrainingLoop
from training_utils.optimization import make_lr_scheduler, make_optimizer, training_length
from training_utils.outputs.export import save_with_ema
from training_utils.outputs.hub import finish_run
from training_utils.outputs.run_status import run_script
from training_utils.parser import add_refused_args
from training_utils.pipeline import prepare_components, trainable_parameters, weight_dtype_for
from training_utils.posthoc_ema import make_posthoc_ema

# The flags of upstream's script that this one does not carry, besides those no script here carries; and the shared
# flags that text has no use for.
NO_IMAGES = "the model trains on text (--text_column, cut to --max_length tokens) and renders text"
REFUSED = {
    "--logging_steps": "the loss and learning rate are logged at every optimizer step",
    **dict.fromkeys(["--train_data_dir", "--image_column", "--caption_column", "--resolution", "--center_crop",
                     "--random_flip", "--image_interpolation_mode", "--caption_dropout", "--skip_corrupt_images",
                     "--validation_height", "--validation_width"], NO_IMAGES),
    **dict.fromkeys(["--validation_guidance_scale", "--validation_true_cfg_scale"],
                    "LLaDA2Pipeline renders without guidance"),
    "--validation_sigma_rels": "validation renders the raw and EMA texts; synthesize post-hoc EMA lengths afterwards "
                               "with python -m training_utils.posthoc_ema",
}
# Upstream's default data; its configuration is the default only for that dataset.
DEFAULT_DATASET = ("wikitext", "wikitext-2-raw-v1")
HOW_TO_LOAD = """
import torch
from diffusers import BlockRefinementScheduler, LLaDA2Pipeline
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{output_dir}")  # or "{output_dir}/ema" for the EMA model
tokenizer = AutoTokenizer.from_pretrained("{output_dir}")
pipe = LLaDA2Pipeline(model=model, scheduler=BlockRefinementScheduler(block_length={block_length}),
                      tokenizer=tokenizer)
text = pipe(prompt="{prompt}", gen_length=256, use_chat_template=False).texts[0]
"""


def parse_args(argv=None):
    parser = training_parser(__doc__.splitlines()[0], validation_inference_steps=32, tracker_project_name="llada2",
                             optional_pretrained_model="a causal LM folder or hub id, with its tokenizer (default: "
                                                       "Qwen/Qwen2.5-0.5B)",
                             pretrained_model_aliases=("--model_name_or_path",))
    # Upstream's names and defaults for the shared flags.
    parser.add_argument("--per_device_train_batch_size", dest="train_batch_size", type=int,
                        help="upstream's --train_batch_size")
    parser.add_argument("--weight_decay", dest="adam_weight_decay", type=float, help="upstream's --adam_weight_decay")
    parser.set_defaults(pretrained_model_name_or_path="Qwen/Qwen2.5-0.5B", dataset_name=DEFAULT_DATASET[0],
                        output_dir="block-refinement-output",
                        max_train_steps=1000, train_batch_size=1, gradient_accumulation_steps=8, learning_rate=2e-5,
                        adam_weight_decay=0.0, lr_scheduler="cosine", lr_warmup_steps=100, num_validation_images=1)
    data = parser.add_argument_group("text")
    data.add_argument("--text_column", default="text", help="the dataset's column of texts (empty ones are dropped)")
    data.add_argument("--use_dummy_data", action="store_true",
                      help="train on random tokens (--num_dummy_samples of --max_length) instead of a dataset")
    data.add_argument("--num_dummy_samples", type=int, default=2048)
    data.add_argument("--max_length", type=int, default=256, help="each text's tokens are cut to this many")
    model = parser.add_argument_group("masked diffusion")
    model.add_argument("--prompt_length", type=int, default=32, help="the leading tokens of each text never masked")
    model.add_argument("--block_length", type=int, default=32,
                       help="the tokens masked together at one rate; also the block validation renders")
    model.add_argument("--lambda_conf", type=float, default=2.0, help="the weight of the confidence (entropy) loss")
    model.add_argument("--conf_temperature", type=float, default=0.5, help="the temperature of the confidence loss")
    validation = parser.add_argument_group("LLaDA2 validation")
    validation.add_argument("--validation_gen_length", type=int, default=128, help="tokens generated per text")
    validation.add_argument("--validation_temperature", type=float, default=0.0,
                            help="the sampling temperature (0: greedy)")
    validation.add_argument("--validation_use_chat_template", action="store_true",
                            help="wrap each prompt in the tokenizer's chat template")
    add_refused_args(parser, REFUSED)
    # What the shared checks read of refused flags.
    parser.set_defaults(train_data_dir=None, resolution=8, caption_dropout=0.0, validation_height=None,
                        validation_width=None, validation_sigma_rels=None)
    args = parser.parse_args(argv)
    check_args(args, check_model=llada2.check_causal_lm_path)
    for flag in ("max_length", "block_length", "num_dummy_samples", "validation_gen_length"):
        require(getattr(args, flag) > 0, f"--{flag}", getattr(args, flag), "a positive integer")
    require(0 <= args.prompt_length < args.max_length, "--prompt_length", args.prompt_length,
            f"a non-negative integer below --max_length ({args.max_length})")
    require(args.lambda_conf >= 0, "--lambda_conf", args.lambda_conf, "a non-negative number")
    require(args.conf_temperature > 0, "--conf_temperature", args.conf_temperature, "a positive number")
    require(args.validation_temperature >= 0, "--validation_temperature", args.validation_temperature,
            "a non-negative number")
    if (args.dataset_name, args.dataset_config_name) == (DEFAULT_DATASET[0], None):
        args.dataset_config_name = DEFAULT_DATASET[1]
    fill_dependent_defaults(args)
    return args


def load_texts(args):
    """The training texts, or None with --use_dummy_data; checked before any weights load."""
    if args.use_dummy_data:
        return None
    dataset = load_train_dataset(args, {"--text_column": args.text_column})
    return llada2.non_empty_texts(dataset, args.text_column, "--text_column")


def main(args, run):
    # 1. Everything that can be wrong with the input fails here, before any weights load.
    texts = load_texts(args)
    config = llada2.check_causal_lm(args)
    require(args.max_length <= getattr(config, "max_position_embeddings", args.max_length), "--max_length",
            args.max_length, f"at most the model's {getattr(config, 'max_position_embeddings', None)} positions")
    accelerator = make_accelerator(args, run)

    # 2. The model and tokenizer, once, in the pipeline that validation renders with; the training noise scheduler
    #    (its masking) is made from the pipeline's scheduler config.
    weight_dtype = weight_dtype_for(accelerator.mixed_precision)
    model, tokenizer = llada2.load_causal_lm(args)
    pipe = LLaDA2Pipeline(model=model, scheduler=BlockRefinementScheduler(block_length=args.block_length),
                          tokenizer=tokenizer)
    pipe.set_progress_bar_config(disable=True)
    noise_scheduler = BlockRefinementScheduler.from_config(pipe.scheduler.config)
    mask_token_id = tokenizer.mask_token_id

    # 3. The whole model trains, in fp32; the EMA is made from its live tensors (no second copy from disk).
    trained = {"model": model}
    model.requires_grad_(True)
    prepare_components(pipe, trained, accelerator.device, weight_dtype)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    compile_repeated_blocks(model, args.torch_compile)
    parameters = trainable_parameters(trained)
    export = llada2.CausalLMExport(model, tokenizer)
    ema = make_ema(args, parameters, accelerator)
    posthoc = make_posthoc_ema(args, parameters, accelerator, export)

    # 4. Data: each text's first --max_length tokens (or random ones), padded to the batch's longest. Optimizer,
    #    schedule, accelerate; the loop resumes if asked.
    def preprocess(example, generator):
        if texts is None:
            return {"input_ids": torch.randint(0, len(tokenizer), (args.max_length,), generator=generator)}
        return {"input_ids": tokenizer(example[args.text_column], truncation=True, max_length=args.max_length,
                                       return_tensors="pt")["input_ids"][0]}

    examples = range(args.num_dummy_samples) if texts is None else texts
    dataloader = accelerator.prepare(make_dataloader(
        TrainDataset(examples, preprocess, args.seed, args.repeats), args.train_batch_size,
        args.dataloader_num_workers, llada2.pad_collate(tokenizer.pad_token_id), args.seed))
    max_train_steps, steps_per_epoch = training_length(args, len(dataloader))
    optimizer = make_optimizer(args, parameters, accelerator.num_processes)
    lr_scheduler = make_lr_scheduler(args, optimizer, max_train_steps, accelerator.num_processes)
    models, optimizer, lr_scheduler = prepare_trained(accelerator, trained, optimizer, lr_scheduler)

    validator = None
    if args.validation_prompt and args.num_validation_images > 0:
        validator = llada2.TextValidator(
            pipe, accelerator, args.output_dir, args.validation_prompt, args.num_validation_images, args.seed,
            ema=ema, schedulers=[noise_scheduler], weight_dtype=weight_dtype,
            call_kwargs={"gen_length": args.validation_gen_length, "block_length": args.block_length,
                         "num_inference_steps": args.validation_inference_steps,
                         "temperature": args.validation_temperature,
                         "use_chat_template": args.validation_use_chat_template})
    loop = TrainingLoop(accelerator, args, run, dataloader, optimizer, lr_scheduler, export, max_train_steps,
                        steps_per_epoch, ema=ema, posthoc=posthoc, validator=validator)
    accelerator.init_trackers(args.tracker_project_name, config=tracker_config(args))

    # 5. The loop: the masked tokens' confidence-aware loss in both complementary views (`llada2`); after each
    # optimizer step the loop updates the EMA, checkpoints and validates when due (the final step included, once).
    for model in models.values():
        model.train()
    for batch in loop:
        with accelerator.accumulate(*models.values()):
            loss, _, _ = llada2.masked_diffusion_loss(
                models["model"], batch["input_ids"], batch["attention_mask"], noise_scheduler, mask_token_id,
                args.prompt_length, args.block_length, args.lambda_conf, args.conf_temperature)
            loop.backward_and_step(loss)

    # 6. Save the model and tokenizer (raw, and the EMA's) from memory, check the files, write the model card.
    if accelerator.is_main_process:
        saved = save_with_ema(export, args.output_dir, ema)
        prompt = args.validation_prompt[0] if args.validation_prompt else "Once upon a time"
        finish_run(args, "LLaDA2 masked text diffusion",
                   HOW_TO_LOAD.format(output_dir=args.output_dir, block_length=args.block_length, prompt=prompt),
                   loop.records, saved, "model")
    end_training(accelerator)


if __name__ == "__main__":
    run_script(main, parse_args)
