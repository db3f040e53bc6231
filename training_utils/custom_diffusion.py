"""Custom Diffusion (Kumari et al.): the UNet's cross-attention projections train (the key and value ones, or all of
them), and the files diffusers' Custom Diffusion loaders read them from.

The projections train in place, as the UNet's own ``attn2.to_k`` / ``attn2.to_v`` (``--freeze_model crossattn``:
also ``to_q`` and ``to_out.0``); nothing else of the UNet does. `CustomDiffusionExport` writes them as
``CustomDiffusionAttnProcessor``'s weights, ``pytorch_custom_diffusion_weights.safetensors``, which
``pipe.unet.load_attn_procs`` loads, and the modifier token's vectors (`embeddings.TextualInversion`) as
``<token>.safetensors``, which ``pipe.load_textual_inversion`` loads.
"""

import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .outputs.export import Export
from .outputs.writing import write_atomically

WEIGHTS_NAME = "pytorch_custom_diffusion_weights.safetensors"
# The cross-attention projections that train, by --freeze_model (upstream's names: what stays trainable).
PROJECTIONS = {"crossattn_kv": ("to_k", "to_v"), "crossattn": ("to_q", "to_k", "to_v", "to_out.0")}
# A trained projection's parameter in the UNet, and its key in CustomDiffusionAttnProcessor's state dict.
_UNET_KEY = re.compile(r"^(?P<attention>.+\.attn2)\.(?P<projection>to_[qkv]|to_out)(?P<index>\.0)?"
                       r"\.(?P<kind>weight|bias)$")
_PROCESSOR_KEY = re.compile(r"^(?P<attention>.+\.attn2)\.processor\.(?P<projection>to_[qkv]|to_out)_custom_diffusion"
                            r"(?P<index>\.0)?\.(?P<kind>weight|bias)$")


def train_cross_attention(unet, freeze_model):
    """Freeze ``unet`` but its cross-attention (``attn2``) projections that ``--freeze_model`` trains. As in
    ``CustomDiffusionAttnProcessor``, the prompt's first token (the start token) gets no gradient through the keys
    and values: their rows of it are detached (`detach_first_token`); their values are unchanged."""
    unet.requires_grad_(False)
    for name, module in unet.named_modules():
        if name.endswith(".attn2"):
            for projection in PROJECTIONS[freeze_model]:
                module.get_submodule(projection).requires_grad_(True)
            for projection in (module.to_k, module.to_v):
                projection.register_forward_hook(detach_first_token)


def detach_first_token(module, inputs, output):
    """A forward hook: ``output`` (batch, tokens, channels) with its first token's row cut from the graph."""
    return torch.cat([output[:, :1].detach(), output[:, 1:]], dim=1)


class CustomDiffusionExport(Export):
    """The trained projections as ``CustomDiffusionAttnProcessor`` weights (every other attention of the UNet an
    empty entry, so that the loader sets a processor for each), and the modifier token's vectors.

    ``processors`` are the UNet's attention processor names; ``embedding`` the trained parameter holding the
    token's rows (None without a modifier token)."""

    kind = "custom_diffusion"
    title = "Custom Diffusion weights"

    def __init__(self, processors, token=None, embedding=None, trained=None):
        super().__init__(trained)
        self.processors, self.token, self.embedding = list(processors), token, embedding

    @classmethod
    def of(cls, trained, token=None, embedding=None):
        return cls(trained["unet"].attn_processors, token, embedding, trained)

    def description(self):
        return {"kind": self.kind, "processors": self.processors, "token": self.token, "embedding": self.embedding}

    @classmethod
    def from_description(cls, description):
        return cls(description["processors"], description["token"], description["embedding"])

    def token_file(self):
        return f"{self.token}.safetensors"

    def write(self, tensors, directory):
        weights = {name: torch.empty(0) for name in self.processors}
        for name, tensor in tensors.items():
            component, _, key = name.partition(".")
            if name == self.embedding:
                continue
            match = _UNET_KEY.match(key) if component == "unet" else None
            if match is None:
                raise ValueError(f"{name} is not a cross-attention projection of the UNet")
            weights.pop(f"{match['attention']}.processor", None)
            weights[f"{match['attention']}.processor.{match['projection']}_custom_diffusion{match['index'] or ''}"
                    f".{match['kind']}"] = tensor.detach().float().cpu().contiguous()

        def write_files(staging):
            save_file(weights, Path(staging, WEIGHTS_NAME), metadata={"format": "pt"})
            if self.token is not None:
                vectors = tensors[self.embedding].detach().float().cpu().contiguous()
                save_file({self.token: vectors}, Path(staging, self.token_file()), metadata={"format": "pt"})

        write_atomically(directory, write_files)
        return Path(directory) / WEIGHTS_NAME

    def read_checkpoint(self, directory):
        tensors = {}
        for key, tensor in load_file(Path(directory) / WEIGHTS_NAME).items():
            match = _PROCESSOR_KEY.match(key)
            if match is not None:
                tensors[f"unet.{match['attention']}.{match['projection']}{match['index'] or ''}.{match['kind']}"] = \
                    tensor
        if self.token is not None:
            tensors[self.embedding] = load_file(Path(directory) / self.token_file())[self.token]
        return tensors

    def loading_code(self, args, pipe):
        """How the model card loads the weights (and the token) into the base pipeline. Diffusers' loader sets the
        processors only when it is given the pipeline (``_pipeline``); without it, it loads nothing."""
        pipeline_class = type(pipe).__name__
        lines = [f"from diffusers import {pipeline_class}", "",
                 f'pipe = {pipeline_class}.from_pretrained("{args.pretrained_model_name_or_path}")',
                 f'pipe.unet.load_attn_procs("{args.output_dir}", weight_name="{WEIGHTS_NAME}", _pipeline=pipe)']
        if self.token is not None:
            lines.append(f'pipe.load_textual_inversion("{args.output_dir}", weight_name="{self.token_file()}")')
        prompt = (args.validation_prompt or [args.instance_prompt])[0]
        return "\n".join([*lines, f'image = pipe("{prompt}").images[0]'])
