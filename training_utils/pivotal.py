"""Pivotal tuning (upstream's advanced DreamBooth scripts): new tokens whose embeddings train in the text encoders
(`embeddings.NewTokens`: every other row bitwise as it loaded) for the first part of the run, beside a LoRA, and the
files that load both.

Each ``--token_abstraction`` (``TOK``) stands for ``--num_new_tokens_per_abstraction`` new tokens ``<s0><s1>``,
numbered on across abstractions, as upstream names them; prompts name the abstraction and `PivotalTokens.replaced`
spells it out. After each step their rows are scaled a little towards the vocabulary's scale
(`PivotalTokens.keep_scale`, upstream's rule). The embeddings stop training after ``--train_text_encoder_ti_frac``
of the optimizer steps (and a text encoder's LoRA after ``--train_text_encoder_frac``): `TrainingStops` drops their
gradients before each step from then on, so the optimizer leaves them bitwise as they were (and `keep_scale` stops
too), also in a run resumed past the stop.

`PivotalExport` writes the LoRA as `adapters.export.LoraExport` does (the UI layouts of ``--export_formats``
included) and the new rows as ``<output folder name>_emb.safetensors``, keyed ``clip_l`` (and SDXL's ``clip_g``, or
FLUX.1's ``t5``): upstream's file, which its README loads with ``load_textual_inversion`` and the UIs load as an
embedding.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .adapters.export import LoraExport
from .embeddings import NewTokens, require_new_tokens
from .errors import UsageError, require
from .outputs.export import Export
from .outputs.writing import verify_saved_tensors, write_atomically

# The keys of upstream's embedding file, by text encoder: SD's and SDXL's CLIP-L and CLIP-G; FLUX.1's CLIP-L and T5.
EMBEDDING_KEYS = {"text_encoder": "clip_l", "text_encoder_2": "clip_g"}
FLUX_EMBEDDING_KEYS = {"text_encoder": "clip_l", "text_encoder_2": "t5"}
EMBEDDING_SUFFIX = "_emb.safetensors"


def embedding_file(output_dir):
    """Upstream's name of the embedding file: ``<output folder name>_emb.safetensors``."""
    return f"{Path(output_dir).resolve().name}{EMBEDDING_SUFFIX}"


def add_pivotal_args(parser):
    """Upstream's pivotal-tuning flags, and FLUX's ``--initializer_concept``."""
    group = parser.add_argument_group("pivotal tuning")
    group.add_argument("--train_text_encoder_ti", action="store_true",
                       help="train new tokens' embeddings (textual inversion) in the text encoders beside the LoRA")
    group.add_argument("--token_abstraction", default="TOK",
                       help="comma-separated words of the prompts that each stand for new tokens (<s0><s1>...)")
    group.add_argument("--num_new_tokens_per_abstraction", type=int, default=2,
                       help="how many new tokens each abstraction stands for")
    group.add_argument("--initializer_concept", default=None,
                       help="words whose embeddings the new tokens start from (their count sets the tokens per "
                            "abstraction); by default random rows of the embedding's standard deviation")
    group.add_argument("--train_text_encoder_ti_frac", type=float, default=0.5,
                       help="the fraction of the optimizer steps during which the new embeddings train")
    group.add_argument("--train_text_encoder_frac", type=float, default=1.0,
                       help="the fraction of the optimizer steps during which the text encoders' LoRA trains")


def check_pivotal_args(args):
    require(args.num_new_tokens_per_abstraction >= 1, "--num_new_tokens_per_abstraction",
            args.num_new_tokens_per_abstraction, "a positive integer")
    for flag in ("--train_text_encoder_ti_frac", "--train_text_encoder_frac"):
        value = getattr(args, flag[2:])
        require(0 < value <= 1, flag, value, "a fraction in (0, 1]")
    require(all(abstraction_list(args.token_abstraction)), "--token_abstraction", args.token_abstraction,
            "comma-separated non-empty words")
    require(args.initializer_concept is None or args.initializer_concept.strip(), "--initializer_concept",
            args.initializer_concept, "one or more words")


def abstraction_list(token_abstraction):
    return "".join(token_abstraction.split()).split(",")


def abstraction_tokens(args, *tokenizers):
    """``{abstraction: [its new tokens]}``, upstream's ``<s0>``, ``<s1>``, ... numbered on across abstractions; with
    ``--initializer_concept``, as many tokens per abstraction as the ``tokenizers`` make of the concept (the most
    of any, as upstream counts CLIP's and T5's)."""
    count = args.num_new_tokens_per_abstraction
    if args.initializer_concept is not None:
        count = max(len(tokenizer.encode(args.initializer_concept, add_special_tokens=False))
                    for tokenizer in tokenizers)
    return {abstraction: [f"<s{index * count + offset}>" for offset in range(count)]
            for index, abstraction in enumerate(abstraction_list(args.token_abstraction))}


def check_new_tokens(tokenizers, abstractions, initializer_concept):
    """Stop, before any weights load, if a tokenizer has one of the new tokens already or makes nothing of the
    initializer concept."""
    require_new_tokens(tokenizers, [token for group in abstractions.values() for token in group],
                       "--token_abstraction", ",".join(abstractions), "new tokens")
    for name, tokenizer in tokenizers.items():
        if initializer_concept is not None and not tokenizer.encode(initializer_concept, add_special_tokens=False):
            raise UsageError("--initializer_concept", initializer_concept, f"words that {name} makes tokens of")


class PivotalTokens(NewTokens):
    """The abstractions' new tokens (`abstraction_tokens`) in each text encoder ``tokenizers`` names, starting as the
    initializer concept's rows (repeated in turn over the tokens, as upstream does) or as random rows of the
    embedding's standard deviation, drawn from ``seed``."""

    def __init__(self, pipe, tokenizers, abstractions, initializer_concept=None, seed=0):
        self.abstractions = abstractions
        tokens = [token for group in abstractions.values() for token in group]

        def initial_rows(tokenizer_name, frozen):
            weight = frozen.weight.detach().float()
            if initializer_concept is None:
                generator = torch.Generator().manual_seed(seed)
                noise = torch.randn(len(tokens), weight.shape[1], generator=generator)
                return noise.to(weight.device) * weight.std()
            ids = pipe.components[tokenizer_name].encode(initializer_concept, add_special_tokens=False)
            return weight[[ids[index % len(ids)] for index in range(len(tokens))]]

        super().__init__(pipe, tokenizers, tokens, initial_rows)

    def keep_scale(self, optimizer, stops):
        """After each step of ``optimizer`` while the new rows train (before `TrainingStops` ``stops`` stops them),
        scale each text encoder's new rows by ``(std of its frozen rows / std of the new rows) ** 0.1``, as upstream
        does after every step: the new rows drift back towards the scale of the vocabulary's."""
        scales = {component: embedding.frozen.weight[:embedding.first_new].detach().float().std()
                  for component, embedding in self.embeddings.items()}

        def rescale(optimizer, args, kwargs):
            if stops.stopped(self.parameters()):
                return
            with torch.no_grad():
                for component, embedding in self.embeddings.items():
                    rows = embedding.new_rows
                    rows.mul_((scales[component].to(rows.device) / rows.float().std()) ** 0.1)

        optimizer.register_step_post_hook(rescale)

    def parameters(self):
        """The trained new rows, one parameter per text encoder."""
        return [embedding.new_rows for embedding in self.embeddings.values()]

    def replaced(self, prompt):
        """``prompt`` with each abstraction spelled out as its tokens (``TOK`` -> ``<s0><s1>``); None stays None."""
        if prompt is None:
            return None
        for abstraction, tokens in self.abstractions.items():
            prompt = prompt.replace(abstraction, "".join(tokens))
        return prompt


class TrainingStops:
    """Parameters that stop training after some optimizer steps (``{stop step: [parameters]}``): from the step `at`
    names on, ``optimizer`` drops their gradients just before it steps (after any clipping and, in a multi-process
    run, after the gradients are averaged), so that AdamW, which skips a parameter without a gradient (its weight
    decay included), leaves them bitwise as they were, as upstream's learning rate of 0 does. The stop depends only
    on the step, so a resumed run stops where the run it resumes did."""

    def __init__(self, optimizer, stops):
        self.step, self.stops = 0, {stop: list(parameters) for stop, parameters in stops.items()}
        optimizer.register_step_pre_hook(self._drop)

    def _drop(self, optimizer, args, kwargs):
        for stop, parameters in self.stops.items():
            if self.step >= stop:
                for parameter in parameters:
                    parameter.grad = None

    def stopped(self, parameters):
        """Whether every one of ``parameters`` has stopped training at the current step."""
        stopped = {id(parameter) for stop, group in self.stops.items() if self.step >= stop for parameter in group}
        return all(id(parameter) in stopped for parameter in parameters)

    def at(self, step):
        """Say that the next gradients are those of optimizer step ``step + 1``."""
        self.step = step


def stop_step(fraction, max_train_steps):
    """The optimizer steps that train for the first ``fraction`` of ``max_train_steps`` (at least one)."""
    return max(1, int(fraction * max_train_steps))


class PivotalExport(Export):
    """The LoRA (``lora``, a `adapters.export.LoraExport` over the trained modules) and the new tokens' rows
    (``parameters``: each text encoder's component name to its trained parameter of the new rows), written
    together: ``pytorch_lora_weights.safetensors`` (and its UI layouts) and ``embedding_file``, keyed as upstream's
    (``keys``, by component: `EMBEDDING_KEYS` or `FLUX_EMBEDDING_KEYS`), which ``load_textual_inversion`` and the UIs
    load."""

    kind = "pivotal"

    def __init__(self, lora, parameters, tokens, embedding_file, trained=None, keys=EMBEDDING_KEYS):
        super().__init__(trained)
        self.lora, self.parameters, self.tokens, self.embedding_file = lora, dict(parameters), tokens, embedding_file
        self.keys = {component: keys[component] for component in self.parameters}

    @property
    def title(self):
        return f"{self.lora.title} and textual inversion embeddings (pivotal tuning)"

    def description(self):
        return {"kind": self.kind, "lora": self.lora.description(), "parameters": self.parameters,
                "tokens": self.tokens, "embedding_file": self.embedding_file, "keys": self.keys}

    @classmethod
    def from_description(cls, description):
        return cls(LoraExport.from_description(description["lora"]), description["parameters"],
                   description["tokens"], description["embedding_file"], keys=description["keys"])

    def write(self, tensors, directory):
        embedding_names = set(self.parameters.values())
        path = self.lora.write({name: tensor for name, tensor in tensors.items() if name not in embedding_names},
                               directory)
        rows = {self.keys[component]: tensors[name].detach().float().cpu().contiguous()
                for component, name in self.parameters.items()}
        write_atomically(directory, lambda staging: save_file(rows, Path(staging, self.embedding_file)))
        verify_saved_tensors(load_file(Path(directory) / self.embedding_file), rows, directory)
        return path

    def read_checkpoint(self, directory):
        """The checkpoint's LoRA and rows; its embedding file is the one ``*_emb.safetensors`` there, whatever the
        output folder that wrote it was called."""
        files = sorted(Path(directory).glob(f"*{EMBEDDING_SUFFIX}"))
        if len(files) != 1:
            raise ValueError(f"{directory} holds {len(files)} *{EMBEDDING_SUFFIX} files, not one")
        rows = load_file(files[0])
        return {**self.lora.read_checkpoint(directory),
                **{name: rows[self.keys[component]] for component, name in self.parameters.items()}}

    def loading_code(self, args, pipe, prompt):
        """The model card's code: the LoRA by ``load_lora_weights``, then the embeddings by
        ``load_textual_inversion`` into each text encoder, as upstream's README loads them."""
        pipeline_class = type(pipe).__name__
        tokenizers = {"text_encoder": "tokenizer", "text_encoder_2": "tokenizer_2"}
        loads = [f'pipe.load_textual_inversion(state_dict["{self.keys[component]}"], token={self.tokens!r}, '
                 f'text_encoder=pipe.{component}, tokenizer=pipe.{tokenizers[component]})'
                 for component in self.parameters]
        return "\n".join([f"from diffusers import {pipeline_class}", "from safetensors.torch import load_file", "",
                          f'pipe = {pipeline_class}.from_pretrained("{args.pretrained_model_name_or_path}")',
                          f'pipe.load_lora_weights("{args.output_dir}")',
                          f'state_dict = load_file("{args.output_dir}/{self.embedding_file}")', *loads,
                          f'image = pipe("{prompt}").images[0]'])
