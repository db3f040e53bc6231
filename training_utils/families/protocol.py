"""The family protocol: what every family module offers a training script, as ``typing.Protocol`` classes whose
static methods are the module-level functions, with their signatures (`ImageFamily`; an edit model's, which takes
reference images, `EditFamily`; a video model's, which states its clips' geometry and which of its denoisers train,
`VideoFamily`). The package's docstring maps what each function is for; `tests/test_families.py`
checks every family module against these.

A function may take parameters besides the protocol's where `OPTIONAL` names them, with those defaults; an edit
family's reference functions may add parameters with defaults (FLUX.1 Kontext's layout: the targets' area).
Families with flags of their own offer both ``add_args(parser)`` and ``check_args(args)``.
"""

from typing import Protocol, runtime_checkable

from .base import VideoGeometry
from .layout import Family

# What a protocol function may take besides its parameters, and their defaults: the wrapped text encoders of a
# family whose text encoders can train; the clips' frames a second (one per sample, None where unknown), which a
# video family's model may condition on (`VideoFamily`).
OPTIONAL = {"encode_prompts": {"text_encoders": None}, "model_inputs": {"frame_rate": None}}


@runtime_checkable
class ImageFamily(Protocol):
    """A family that trains a model to make images (or videos) from text."""

    FAMILY: Family  # its pipeline classes and LoRA layouts

    @staticmethod
    def prompt_settings(pipe, args):
        """How prompts are encoded: in training, validation and class images alike."""

    @staticmethod
    def call_kwargs(pipe, settings):
        """What every render passes to the pipeline."""

    @staticmethod
    def prompt_dependencies(pipe, settings):
        """What the prompts' rows depend on besides the text encoders' weights (the disk cache's key)."""

    @staticmethod
    def encode_prompts(pipe, prompts, device, settings):
        """Batch-first parts, a row per prompt."""

    @staticmethod
    def text_inputs(rows):
        """A batch's text inputs, from its samples' rows."""

    @staticmethod
    def image_vae(pipe):
        """The VAE as `data.frozen_encoders.FrozenEncoders` drives it (images in)."""

    @staticmethod
    def normalized_latents(pipe, latents):
        """The VAE's latents as the model reads them."""

    @staticmethod
    def model_inputs(pipe, noisy_latents, timesteps, text):
        """All the model's keyword inputs."""

    @staticmethod
    def prediction(pipe, output, latents):
        """The model's output in the latents' layout, with the loss target's sign."""


@runtime_checkable
class EditFamily(ImageFamily, Protocol):
    """A family whose pipeline also takes reference images: the model reads their latents after the target's."""

    @staticmethod
    def model_inputs(pipe, noisy_latents, timesteps, text, references=()):
        """All the model's keyword inputs, the `reference_latents` ``references`` among them."""

    @staticmethod
    def reference_layout(pipe):
        """``(lay_out, depends_on)`` for `data.edit_samples.References`."""

    @staticmethod
    def check_reference_size(width, height):
        """Raise ValueError for a reference size the pipeline refuses."""

    @staticmethod
    def reference_latents(pipe, parameters):
        """A batch's references as the pipeline encodes them, from their VAE latent distributions' parameters."""


@runtime_checkable
class VideoFamily(ImageFamily, Protocol):
    """A family that trains a model to make videos: the geometry of its clips, and its denoisers (one transformer, or
    experts that split the noise levels, as Wan 2.2's), so that a video script's loop names none of them."""

    VIDEO: VideoGeometry  # its clips' geometry: `data.video` reads nothing else of the family
    DENOISERS: tuple  # the pipeline's components that denoise: the quantised base

    @staticmethod
    def video_geometry(args):
        """The geometry of the pipeline ``args`` names, before any weights load: ``VIDEO``, or where a family's
        pipelines differ (Wan TI2V's VAE, 16× in space), what its configs state."""

    @staticmethod
    def model_inputs(pipe, noisy_latents, timesteps, text, frame_rate=None):
        """All the model's keyword inputs, for clips of ``frame_rate`` frames a second (a list, one a sample)."""

    @staticmethod
    def trained_denoisers(pipe, args):
        """``{component: module}`` of the denoisers that train, as the flags choose them."""

    @staticmethod
    def step_denoiser(pipe, noise_scheduler, trained, seed, step):
        """The component of ``trained`` that optimizer step ``step`` trains, the same on every process and after
        resuming."""

    @staticmethod
    def sample_denoiser_timesteps(pipe, noise_scheduler, args, latents, denoiser):
        """``(timesteps, sigmas)`` of a batch, drawn from the noise levels ``denoiser`` takes."""
