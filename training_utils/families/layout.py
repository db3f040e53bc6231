"""How a family's LoRA files are laid out for the UI tools: the record each family module declares (`Family`), and
the renaming rules (`Rename`, `fused`) from diffusers' module paths to those of the original release, which
ComfyUI's models have. `training_utils.adapters.convert` applies them."""

from collections.abc import Callable
from dataclasses import dataclass, field

# The layouts a LoRA file is written in besides diffusers' own: kohya's (A1111, Forge, kohya's tools) and ComfyUI's.
FORMATS = ("kohya", "comfyui")
# The diffusers module paths of a transformer block's layers start so, the block's index captured.
BLOCK = r"transformer_blocks\.(\d+)\."
# The kohya prefixes of SDXL's and SD3's two CLIP text encoders.
CLIP_PAIR = {"text_encoder": "lora_te1", "text_encoder_2": "lora_te2"}


def always(rows, columns):
    return True


def two_chunk_modulation(rows, columns):
    """Whether an adaLN layer of ``rows`` outputs and ``columns`` inputs makes two chunks (shift and scale, as
    ``AdaLayerNormContinuous``) rather than six (``AdaLayerNormZero``): SD3's last block, which ``mmdit_to_diffusers``
    swaps and the others it does not."""
    return rows == 2 * columns


@dataclass(frozen=True)
class Rename:
    """Diffusers module paths that fully match ``pattern`` are the original model's module ``original`` (a
    ``re.sub`` template), or, where the original fuses several diffusers layers into one, the row block of part
    ``part`` of ``sizes`` (the parts' relative numbers of rows, in the original's order: ``(1, 1, 1)`` for q, k and
    v; ``(1, 1, 1, 4)`` for q, k, v and an MLP projection four times wider). ``swap_halves(rows, columns)`` says
    whether the original orders the outputs' two halves the other way round (the layer's outputs, inputs)."""

    pattern: str
    original: str
    part: int = 0
    sizes: tuple = (1,)
    swap_halves: Callable | None = None

    @property
    def parts(self):
        return len(self.sizes)


def fused(pattern, original, names, sizes=None):
    """The rules for diffusers layers ``names`` (in the original's row order) that ``original`` fuses; ``pattern``
    has one ``{}`` where a name goes; ``sizes`` are the parts' relative numbers of rows (all alike by default)."""
    sizes = tuple(sizes or (1,) * len(names))
    return tuple(Rename(pattern.format(name), original, part, sizes) for part, name in enumerate(names))


@dataclass(frozen=True)
class Family:
    """A model family's LoRA layout: its name (``--family``), its title, the pipeline classes whose LoRAs it lays out
    (by exact class name), its denoiser component, the kohya prefix of each text encoder, and for a transformer the
    `Rename` rules of its original layout, which ComfyUI's model has."""

    name: str
    title: str
    pipelines: tuple
    denoiser: str
    text_encoders: dict = field(default_factory=dict)
    original_layout: tuple = ()

    @property
    def formats(self):
        # kohya's tools know only UNet models; ComfyUI takes the kohya file for those too, and a transformer's in its
        # original layout (none where ComfyUI has no model of the family).
        if self.denoiser == "unet":
            return FORMATS
        return ("comfyui",) if self.original_layout else ()

    @property
    def components(self):
        return {self.denoiser, *self.text_encoders}
