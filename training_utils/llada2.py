"""LLaDA2's masked text diffusion on a causal LM (`examples/discrete_diffusion/train_llada2.py`).

The model is any causal LM that transformers has built in (``AutoModelForCausalLM``), with its tokenizer, from one
folder or hub id, as upstream's script loads it; a model whose code comes from the hub (``trust_remote_code``, as
LLaDA2.0's own ``LLaDA2MoeModelLM``) is refused before any weights load (`check_causal_lm`). It trains on texts with
their tokens masked block by block (``BlockRefinementScheduler.add_noise``) and learns them back in two complementary
views (`masked_diffusion_loss`); ``LLaDA2Pipeline`` renders with it. The trained model is written with its tokenizer
as one folder (`CausalLMExport`), and validation writes texts, not images (`TextValidator`).
"""

import contextlib
import json
from pathlib import Path

import torch

from .errors import UsageError, require
from .grids import BASE, read_log
from .names import LOG_NAME, VALIDATION_DIR
from .outputs.export import ModelExport
from .outputs.writing import write_atomically
from .pipeline import is_hub_id, modules_of, preserved_state

# Upstream's mask token for a tokenizer that has none (LLaDA2's own tokenizers have ``<|mask|>``).
ADDED_MASK_TOKEN = "[MASK]"
MODEL_FLAG = "--model_name_or_path"


def check_causal_lm_path(value, read_weights=True):
    """A folder holding a model's ``config.json`` (with ``read_weights``, its safetensors files whole) or a hub id."""
    from .args import safetensors_problem

    path = Path(value).expanduser()
    if not path.exists():
        require(is_hub_id(value), MODEL_FLAG, value, "an existing causal LM folder or a hub id (owner/name)")
        return
    require(path.is_dir() and (path / "config.json").is_file(), MODEL_FLAG, value,
            "a causal LM folder (with config.json) or a hub id")
    for weights in sorted(path.glob("*.safetensors")) if read_weights else ():
        problem = safetensors_problem(weights)
        require(problem is None, MODEL_FLAG, value, f"a model whose weight files are whole: {weights} {problem}")


def check_causal_lm(args):
    """The model's config, read (no weights) and checked to be a causal LM that transformers builds itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    expected = ("a causal LM that transformers has built in (AutoModelForCausalLM, e.g. Qwen2.5, Llama, Mistral); "
                "code from the hub (trust_remote_code, as LLaDA2.0's LLaDA2MoeModelLM) is never run here")
    try:
        config = AutoConfig.from_pretrained(args.pretrained_model_name_or_path, revision=args.revision,
                                            cache_dir=args.cache_dir)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(MODEL_FLAG, args.pretrained_model_name_or_path, f"{expected} ({error})") from None
    require(type(config) in AutoModelForCausalLM._model_mapping, MODEL_FLAG, args.pretrained_model_name_or_path,
            f"{expected}, not a {type(config).__name__}")
    return config


def load_causal_lm(args):
    """``(model, tokenizer)`` as upstream's script makes them: the tokenizer pads with its end-of-text token where it
    has no padding token, and gets `ADDED_MASK_TOKEN` where it has no mask token, the model's embeddings resized to
    it. The model loads in fp32: it trains whole."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location = {"revision": args.revision, "cache_dir": args.cache_dir}
    tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path, **location)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if tokenizer.mask_token_id is None:
        tokenizer.add_special_tokens({"mask_token": ADDED_MASK_TOKEN})
    model = AutoModelForCausalLM.from_pretrained(args.pretrained_model_name_or_path, dtype=torch.float32,
                                                 use_safetensors=True, **location)
    if model.get_input_embeddings().num_embeddings < len(tokenizer):
        model.resize_token_embeddings(len(tokenizer))
    return model, tokenizer


def non_empty_texts(dataset, column, flag):
    """The rows of ``dataset`` whose ``column`` holds text, not only whitespace (upstream drops the others)."""
    dataset = dataset.filter(lambda text: isinstance(text, str) and bool(text.strip()), input_columns=column)
    require(len(dataset) > 0, flag, column, "a column holding some non-empty text")
    return dataset


def pad_collate(pad_token_id):
    """A collate of ``{"input_ids"}`` samples of any lengths: ``input_ids`` padded on the right to the longest with
    ``pad_token_id`` and the ``attention_mask`` (1 on the tokens, 0 on the padding), as upstream's collator pads."""

    def collate(examples):
        ids = [example["input_ids"] for example in examples]
        length = max(len(sample) for sample in ids)
        input_ids = torch.full((len(ids), length), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), length), dtype=torch.long)
        for row, sample in enumerate(ids):
            input_ids[row, :len(sample)] = sample
            attention_mask[row, :len(sample)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}

    return collate


def masked_diffusion_loss(model, input_ids, attention_mask, noise_scheduler, mask_token_id, prompt_length,
                          block_length, lambda_conf, temperature):
    """Upstream's objective: the tokens after the first ``prompt_length`` masked block by block at a random rate
    (``noise_scheduler.add_noise``), and the complementary view with the other tokens masked; in each view the
    model, never predicting the mask token, learns the masked tokens back by cross-entropy, plus ``lambda_conf``
    times an entropy penalty at ``temperature`` on the tokens it already gets right
    (``diffusers.training_utils.compute_confidence_aware_loss``). Returns (loss, its cross-entropy part, its
    confidence part), each summed over the two views."""
    from diffusers.training_utils import compute_confidence_aware_loss

    valid = attention_mask.bool()
    views = noise_scheduler.add_noise(input_ids, attention_mask, prompt_length=prompt_length,
                                      block_length=block_length, mask_token_id=mask_token_id)
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    total = torch.zeros(3, device=input_ids.device)
    for noisy, masked in ((views[0], views[2]), (views[1], views[3])):
        logits = model(input_ids=noisy, attention_mask=attention_mask, position_ids=position_ids).logits.float()
        logits[..., mask_token_id] = torch.finfo(logits.dtype).min
        masked = masked & valid
        labels = input_ids.masked_fill(~masked, -100)
        total = total + torch.stack(compute_confidence_aware_loss(
            logits, labels, lambda_conf=lambda_conf, temperature=temperature,
            per_token_weights=masked.to(logits.dtype)))
    return total[0], total[1], total[2]


class CausalLMExport(ModelExport):
    """The trained causal LM with its tokenizer, in one folder that ``AutoModelForCausalLM.from_pretrained`` and
    ``AutoTokenizer.from_pretrained`` load (the output folder, ``ema/``, each checkpoint's ``model/``). Described
    (post-hoc EMA syntheses) as a `ModelExport` of the model alone."""

    def __init__(self, model, tokenizer):
        trained = {"model": model}
        super().__init__(ModelExport.of(trained).configs, trained)
        self.tokenizer = tokenizer

    def save(self, directory):
        super().save(directory)
        write_atomically(directory, self.tokenizer.save_pretrained)
        return Path(directory)

    def save_checkpoint(self, directory):
        super().save_checkpoint(directory)
        write_atomically(Path(directory) / "model", self.tokenizer.save_pretrained)
        return Path(directory)


def text_path(step, variant, prompt_index, text_index):
    """Where a validation text is written, relative to the output folder."""
    return f"{VALIDATION_DIR}/step-{step:06d}/{variant}-p{prompt_index:02d}-{text_index:02d}.txt"


class TextValidator:
    """Renders the validation prompts into texts with ``LLaDA2Pipeline`` on the live model, as `validation.Validator`
    renders images, with no side effect on training: the pipeline's scheduler and ``schedulers`` are restored after,
    every module's train/eval mode too, and texts are sampled with seeded generators inside a forked RNG.

    Each call renders every prompt ``num_texts`` times (generators seeded ``seed``, ``seed + 1``, ...), with the raw
    weights and then the EMA's (variants ``raw`` and ``ema``; step 0 the base model, variant ``base``), writes each
    text to `text_path` and appends one record a prompt and variant to ``validation/log.jsonl``:
    ``{"step", "variant", "prompt", "texts", "files"}``. Every process renders (text is cheap beside training); the
    main process writes.
    """

    def __init__(self, pipe, accelerator, output_dir, prompts, num_texts, seed, ema=None, schedulers=(),
                 weight_dtype=torch.float32, call_kwargs=None):
        self.pipe = pipe
        self.accelerator = accelerator
        self.output_dir = Path(output_dir)
        self.prompts = list(prompts)
        self.num_texts = num_texts
        self.seed = seed
        self.ema = ema
        self.schedulers = list(schedulers)
        self.weight_dtype = weight_dtype
        self.call_kwargs = call_kwargs or {}

    def draw_base(self):
        """Render the base model as step 0, unless the log holds it (a run started over in its folder)."""
        drawn = any(record["step"] == 0 for record in read_log(self.output_dir))
        self.accelerator.wait_for_everyone()
        if not drawn:
            self(0)

    def card_records(self, records):
        """Nothing for the model card, which shows images: the texts are in ``validation/``."""
        return []

    def __call__(self, step, final=False):
        variants = [(BASE, contextlib.nullcontext)] if step == 0 else [("raw", contextlib.nullcontext)]
        if step > 0 and self.ema is not None:
            variants.append(("ema", self.ema.swapped_in))
        records = []
        modules = modules_of(self.pipe).values()
        with preserved_state([self.pipe.scheduler, *self.schedulers], modules):
            for module in modules:
                module.eval()
            for variant, weights in variants:
                with weights():
                    for index, prompt in enumerate(self.prompts):
                        texts = self._render(prompt)
                        files = [text_path(step, variant, index, number) for number in range(len(texts))]
                        records.append({"step": step, "variant": variant, "prompt": prompt, "texts": texts,
                                        "files": files})
        if self.accelerator.is_main_process:
            self._write(step, records)
        self.accelerator.wait_for_everyone()
        return records

    def _render(self, prompt):
        autocast = (torch.autocast(self.accelerator.device.type, dtype=self.weight_dtype)
                    if self.weight_dtype != torch.float32 else contextlib.nullcontext())
        fork_devices = [self.accelerator.device] if self.accelerator.device.type == "cuda" else []
        texts = []
        with torch.random.fork_rng(devices=fork_devices), autocast, torch.no_grad():
            for number in range(self.num_texts):
                generator = torch.Generator(self.accelerator.device).manual_seed(self.seed + number)
                texts.append(self.pipe(prompt=prompt, generator=generator, **self.call_kwargs).texts[0])
        return texts

    def _write(self, step, records):
        folder = self.output_dir / VALIDATION_DIR / f"step-{step:06d}"
        folder.mkdir(parents=True, exist_ok=True)
        for record in records:
            for path, text in zip(record["files"], record["texts"]):
                (self.output_dir / path).write_text(text)
        with open(self.output_dir / VALIDATION_DIR / LOG_NAME, "a") as log:
            log.writelines(json.dumps(record) + "\n" for record in records)
        for tracker in self.accelerator.trackers:
            for record in records:
                tag = f"validation/{record['variant']}/p{self.prompts.index(record['prompt']):02d}"
                text = "\n\n".join(record["texts"])
                if tracker.name == "tensorboard":
                    tracker.writer.add_text(tag, text, step)
                elif tracker.name == "wandb":
                    tracker.log({tag: text}, step=step)
