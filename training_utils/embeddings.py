"""Textual inversion: new tokens whose input-embedding rows train, while every other row of the text encoder stays
bitwise as it loaded, and the files that ``load_textual_inversion`` and the UIs load them from.

A placeholder token of ``--num_vectors`` vectors is the token and ``<token>_1``, ``<token>_2``, ... in the
tokenizer, as diffusers' ``load_textual_inversion`` names them: a prompt names the token once and the pipeline's
``maybe_convert_prompt`` spells out its vectors, in training (`TextualInversion.spelled_out`) as in validation.

The new rows are a parameter of their own (`NewTokenEmbedding`), not rows of the loaded matrix that are restored
after each step: only they are trained, averaged by the EMA, checkpointed and saved, and nothing else can change.
"""

import contextlib
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from .errors import UsageError, require
from .outputs.export import Export
from .outputs.writing import write_atomically
from .pipeline import trainable_parameters

EMBEDDINGS_NAME = "learned_embeds.safetensors"
# The single file that AUTOMATIC1111's web UI and ComfyUI load an embedding from: the token's vectors under one key
# per text encoder (SD 1.x/2.x: one; SDXL: CLIP-L's and CLIP-G's).
UI_KEYS = {1: ("emb_params",), 2: ("clip_l", "clip_g")}
# What a sample's prompt says of the placeholder (``{}``), by --learnable_property: what the subject is, or how
# the picture is made.
TEMPLATES = {
    "object": ("a photo of a {}", "a picture of the {}", "a close-up photo of a {}", "a photo of one {}",
               "a bright photo of the {}", "a dim photo of a {}", "a cropped photo of the {}", "a rendering of a {}",
               "a photo of a small {}", "a photo of a large {}", "a clean photo of the {}", "an image of a {}"),
    "style": ("a painting in the style of {}", "a picture in the style of {}", "an image in the style of {}",
              "a drawing in the style of {}", "an artwork in the style of {}", "a rendering in the style of {}",
              "a small painting in the style of {}", "a large picture in the style of {}",
              "a bright image in the style of {}", "a dark picture in the style of {}"),
}


def add_textual_inversion_args(parser):
    """Upstream's textual-inversion flags: the new token, its initialiser and size, what it learns, the
    intermediate embedding files."""
    group = parser.add_argument_group("textual inversion")
    group.add_argument("--placeholder_token", required=True, help="the new token, e.g. <cat-toy>")
    group.add_argument("--initializer_token", required=True,
                       help="an existing word (one token) whose embedding the new vectors start from")
    group.add_argument("--num_vectors", type=int, default=1, help="how many embedding vectors the token has")
    group.add_argument("--learnable_property", default="object", choices=sorted(TEMPLATES),
                       help="what the token stands for: the subject (object) or the manner (style)")
    group.add_argument("--save_steps", type=int, default=500,
                       help="also write the embedding as learned_embeds-steps-N.safetensors every N optimizer steps")
    group.add_argument("--save_as_full_pipeline", action="store_true",
                       help="also write the whole pipeline, its tokenizer and text encoder holding the new token")


def check_textual_inversion_args(args):
    require(args.num_vectors >= 1, "--num_vectors", args.num_vectors, "a positive integer")
    require(args.save_steps >= 1, "--save_steps", args.save_steps, "a positive integer")
    require(args.placeholder_token.strip() == args.placeholder_token and args.placeholder_token,
            "--placeholder_token", args.placeholder_token, "a token without spaces around it")
    require(" " not in args.placeholder_token, "--placeholder_token", args.placeholder_token,
            "one word (the token's vectors are spelled out as <token>_1, <token>_2, ...)")


def placeholder_tokens(token, num_vectors):
    """The token of each vector, as ``load_textual_inversion`` names a multi-vector embedding's."""
    return [token] + [f"{token}_{index}" for index in range(1, num_vectors)]


class NewTokenEmbedding(torch.nn.Module):
    """An input embedding whose rows are the frozen ``frozen`` embedding's first ``first_new`` (all of them by
    default), followed by ``new_rows``, which train.

    The ids from ``first_new`` on read the new ones; the frozen matrix is neither copied nor concatenated. (T5's
    matrix has padding rows past its tokenizer's ids: the new tokens' ids, the tokenizer's next, take their places,
    as ``load_textual_inversion``'s resize to the tokenizer's length gives them.)"""

    def __init__(self, frozen, new_rows, first_new=None):
        super().__init__()
        self.frozen = frozen.requires_grad_(False)
        self.new_rows = torch.nn.Parameter(new_rows.detach().clone())
        self.first_new = frozen.num_embeddings if first_new is None else first_new

    @property
    def weight(self):
        """The whole matrix, as the text encoder's ``get_input_embeddings().weight`` has it."""
        return torch.cat([self.frozen.weight[:self.first_new], self.new_rows.to(self.frozen.weight.dtype)])

    def forward(self, input_ids):
        is_new = (input_ids >= self.first_new).unsqueeze(-1)
        old = self.frozen(input_ids.clamp(max=self.first_new - 1))
        new = self.new_rows[(input_ids - self.first_new).clamp(min=0)].to(old.dtype)
        return torch.where(is_new, new, old)


def load_tokenizers(args, names):
    """The pipeline's tokenizers ``names``, loaded alone (no weights), for `check_placeholder_token` to check the
    flags against before any weights load; `pipeline.load_pipeline` then takes them as the pipeline's."""
    return {name: AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path, subfolder=name,
                                                revision=args.revision) for name in names}


def require_new_tokens(tokenizers, tokens, flag, value, what):
    """Stop in one line naming ``flag=value`` (``what``: "a token", "new tokens") if a tokenizer of ``tokenizers`` (by
    name) has one of ``tokens`` already."""
    for name, tokenizer in tokenizers.items():
        taken = [token for token in tokens if token in tokenizer.get_vocab()]
        if taken:
            raise UsageError(flag, value, f"{what} that {name} does not have already ({', '.join(taken)} is one of its "
                                          "tokens)")


def check_placeholder_token(tokenizers, token, num_vectors, initializer_token, token_flag="--placeholder_token"):
    """Each tokenizer's id of ``initializer_token`` (by tokenizer name), after checking that the token's vectors
    are new to every tokenizer (the error naming the token as ``token_flag``) and that the initialiser is one token
    of each."""
    require_new_tokens(tokenizers, placeholder_tokens(token, num_vectors), token_flag, token, "a token")
    initializer_ids = {}
    for name, tokenizer in tokenizers.items():
        ids = tokenizer.encode(initializer_token, add_special_tokens=False)
        if len(ids) != 1:
            raise UsageError("--initializer_token", initializer_token, f"one token of {name}, not {len(ids)}")
        initializer_ids[name] = ids[0]
    return initializer_ids


class NewTokens:
    """New ``tokens`` added to each text encoder of ``pipe`` that ``tokenizers`` names (text encoder component name:
    its tokenizer's), their rows a `NewTokenEmbedding` starting as ``initial_rows(tokenizer name, frozen embedding)``
    (a ``(len(tokens), hidden size)`` tensor); ``text_encoders`` are those modules, by component name, whose new rows
    train, and ``embeddings`` their `NewTokenEmbedding` modules."""

    def __init__(self, pipe, tokenizers, tokens, initial_rows):
        self.pipe, self.tokens = pipe, list(tokens)
        self.text_encoders, self.embeddings = {}, {}
        for component, tokenizer_name in tokenizers.items():
            tokenizer, text_encoder = pipe.components[tokenizer_name], pipe.components[component]
            frozen, first_new = text_encoder.get_input_embeddings(), len(tokenizer)
            added = tokenizer.add_tokens(self.tokens)
            ids = tokenizer.convert_tokens_to_ids(self.tokens)
            if (added != len(self.tokens) or ids != list(range(first_new, first_new + added))
                    or first_new > frozen.num_embeddings):
                raise ValueError(f"{tokenizer_name} gave the new tokens ids {ids}, not the rows after its "
                                 f"{first_new} tokens within {component}'s {frozen.num_embeddings}")
            self.embeddings[component] = NewTokenEmbedding(frozen, initial_rows(tokenizer_name, frozen), first_new)
            text_encoder.requires_grad_(False)
            text_encoder.set_input_embeddings(self.embeddings[component])
            self.text_encoders[component] = text_encoder

    def parameter_names(self, trained):
        """Each text encoder's name of its new rows among the trained parameters (``<component>.<path>.new_rows``),
        by component name."""
        names = {}
        for component, embedding in self.embeddings.items():
            path = next(name for name, module in trained[component].named_modules() if module is embedding)
            names[component] = f"{component}.{path}.new_rows"
        return names


class TextualInversion(NewTokens):
    """The placeholder token added to each text encoder of ``pipe`` that ``tokenizers`` names (text encoder component
    name: its tokenizer's), its vectors starting as ``initializer_token``'s embedding (`check_placeholder_token`);
    ``text_encoders`` are those modules, by component name, whose new rows train."""

    def __init__(self, pipe, tokenizers, token, num_vectors, initializer_token):
        self.token = token
        initializer_ids = check_placeholder_token({name: pipe.components[name] for name in tokenizers.values()},
                                                  token, num_vectors, initializer_token)
        super().__init__(pipe, tokenizers, placeholder_tokens(token, num_vectors),
                         lambda tokenizer_name, frozen: frozen.weight[initializer_ids[tokenizer_name]].float()
                         .expand(num_vectors, -1))

    def spelled_out(self, prompts):
        """``prompts`` with the token's vectors spelled out, by the pipeline's own ``maybe_convert_prompt``."""
        return self.pipe.maybe_convert_prompt(list(prompts), self.pipe.tokenizer)

    def templated_prompt(self, learnable_property, generator):
        """A prompt naming the token, of the property's templates, drawn with ``generator``."""
        templates = TEMPLATES[learnable_property]
        return templates[int(torch.randint(len(templates), (1,), generator=generator))].format(self.token)

    @contextlib.contextmanager
    def merged(self):
        """Each text encoder with a plain input embedding of all its rows, the new ones included, and a config
        saying so: what ``save_pretrained`` writes for ``from_pretrained`` to load with the tokenizer."""
        text_encoders = [(self.text_encoders[component], embedding, self.text_encoders[component].config.vocab_size)
                         for component, embedding in self.embeddings.items()]
        try:
            for text_encoder, embedding, _ in text_encoders:
                weight = embedding.weight.detach()
                text_encoder.set_input_embeddings(torch.nn.Embedding.from_pretrained(weight, freeze=True))
                text_encoder.config.vocab_size = weight.shape[0]
            yield
        finally:
            for text_encoder, embedding, vocab_size in text_encoders:
                text_encoder.set_input_embeddings(embedding)
                text_encoder.config.vocab_size = vocab_size

    def export(self, trained):
        """The `EmbeddingExport` of the new rows, keyed by the trained components' parameter names."""
        return EmbeddingExport(self.token, self.parameter_names(trained), trained)


class EmbeddingExport(Export):
    """The embedding's files: ``learned_embeds.safetensors`` (``{token: vectors}``; SDXL's second encoder's in
    ``learned_embeds_2.safetensors``), which ``pipe.load_textual_inversion`` loads, and ``<token>.safetensors`` in
    the layout the UIs load (`UI_KEYS`), named after the token that its file name triggers there.

    ``parameters`` maps each text encoder's component name to the trained parameter holding its new rows."""

    kind = "embeddings"
    title = "textual inversion embedding"

    def __init__(self, token, parameters, trained=None):
        super().__init__(trained)
        self.token, self.parameters = token, dict(parameters)

    def description(self):
        return {"kind": self.kind, "token": self.token, "parameters": self.parameters}

    @classmethod
    def from_description(cls, description):
        return cls(description["token"], description["parameters"])

    def diffusers_files(self):
        """The ``load_textual_inversion`` file of each text encoder, by component name."""
        return {component: EMBEDDINGS_NAME if index == 0 else f"learned_embeds_{index + 1}.safetensors"
                for index, component in enumerate(self.parameters)}

    def ui_file(self):
        return re.sub(r"[^\w.-]+", "", self.token) or "embedding"

    def write(self, tensors, directory):
        vectors = {component: tensors[name].detach().float().cpu().contiguous()
                   for component, name in self.parameters.items()}

        def write_files(staging):
            for component, name in self.diffusers_files().items():
                save_file({self.token: vectors[component]}, Path(staging, name), metadata={"format": "pt"})
            save_file(dict(zip(UI_KEYS[len(vectors)], vectors.values())),
                      Path(staging, f"{self.ui_file()}.safetensors"))

        write_atomically(directory, write_files)
        return Path(directory) / EMBEDDINGS_NAME

    def read_checkpoint(self, directory):
        files = self.diffusers_files()
        return {name: load_file(Path(directory) / files[component])[self.token]
                for component, name in self.parameters.items()}

    def loading_code(self, args, pipe):
        """How the model card loads the embedding into the base pipeline and uses it."""
        pipeline_class = type(pipe).__name__
        loads = [f'pipe.load_textual_inversion("{args.output_dir}", weight_name="{EMBEDDINGS_NAME}")']
        if len(self.parameters) == 2:
            loads = [f'pipe.load_textual_inversion("{args.output_dir}/{file}", token="{self.token}", '
                     f'text_encoder=pipe.{component}, tokenizer=pipe.{tokenizer})'
                     for (component, file), tokenizer in zip(self.diffusers_files().items(),
                                                             ("tokenizer", "tokenizer_2"))]
        prompt = args.validation_prompt[0] if args.validation_prompt else f"a photo of a {self.token}"
        return "\n".join([f"from diffusers import {pipeline_class}", "",
                          f'pipe = {pipeline_class}.from_pretrained("{args.pretrained_model_name_or_path}")',
                          *loads, f'image = pipe("{prompt}").images[0]'])


def write_progress(export, directory, step):
    """The live embedding as ``learned_embeds-steps-N.safetensors`` in ``directory`` (``--save_steps``; SDXL's second
    encoder's as ``learned_embeds_2-steps-N.safetensors``), written together, atomically: the diffusers files that
    ``load_textual_inversion`` loads."""
    tensors = trainable_parameters(export.trained)
    files = export.diffusers_files()

    def write_files(staging):
        for component, name in export.parameters.items():
            vectors = {export.token: tensors[name].detach().float().cpu().contiguous()}
            stem = Path(files[component]).stem
            save_file(vectors, Path(staging, f"{stem}-steps-{step}.safetensors"), metadata={"format": "pt"})

    write_atomically(directory, write_files)
