"""What several families do alike, written once: the protocol's functions that are the same in several families
(`protocol`), the shared flags (each declared here only, with one default), and the small text helpers the
families' encodings use. A family whose protocol function is one of these binds its name to it
(``image_vae = base.image_vae``). It imports torch and `training_utils.errors` only, so that importing a family
pulls in nothing else of the package.
"""

import inspect
from typing import NamedTuple

import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

from ..errors import UsageError, require


class VideoGeometry(NamedTuple):
    """What a video family's module states of its clips as ``VIDEO`` (the data layer reads nothing else of it):

    - ``spatial``, ``temporal``: the VAE's compression in space and in time; a clip it takes has ``temporal·k + 1``
      frames (`takes`), and the fewest that are still a video, one latent frame past the first, is `min_frames`;
    - ``size_multiple``: what ``--resolution`` and each side of a render must be a multiple of (the VAE's spatial
      factor times the transformer's patch, as the pipeline's ``check_inputs`` asks);
    - ``fps``: the frame rate the model renders at natively (validation mp4s and the model card's code);
    - ``output_type``: what validation asks the pipeline's ``.frames`` to be;
    - ``stills``: whether a still image trains as a one-frame clip beside the videos (a family whose model takes no
      one-latent-frame input says False, and a still image in its data stops the run).
    """

    spatial: int
    temporal: int
    size_multiple: int
    fps: int
    output_type: str
    stills: bool = True

    @property
    def min_frames(self):
        """The fewest frames a clip needs to train as a video: two latent frames."""
        return self.temporal + 1

    def takes(self, frames):
        """Whether the VAE takes a clip of ``frames`` frames (``temporal·k + 1``)."""
        return frames > 0 and (frames - 1) % self.temporal == 0

    def frame_counts(self, count=3):
        """The first ``count`` frame counts the VAE takes, for messages: ``1, temporal + 1, ...``."""
        return [k * self.temporal + 1 for k in range(count)]

    def counts_up_to(self, frames):
        """Every count the VAE takes that is still a video, from `min_frames` to ``frames`` (or ``[frames]`` when
        ``frames`` is shorter: one frame, by choice)."""
        return list(range(self.min_frames, frames + 1, self.temporal)) or [frames]


def fixed_geometry(video):
    """`protocol.VideoFamily.video_geometry` of a family whose every pipeline has the geometry ``video``."""
    def video_geometry(args):
        return video

    return video_geometry


def only_transformer(pipe, args):
    """`protocol.VideoFamily.trained_denoisers` of a family with one denoiser: ``{"transformer": pipe.transformer}``."""
    return {"transformer": pipe.transformer}


def only_denoiser(pipe, noise_scheduler, trained, seed, step):
    """`protocol.VideoFamily.step_denoiser` of a family with one denoiser: every step trains it."""
    return next(iter(trained))


def load_adapter_lines(export, output_dir):
    """The model card's lines that load the adapters of ``export`` (`adapters.export.adapter_export`) from
    ``output_dir``: a LoRA or DoRA with ``load_lora_weights``, any other adapter with peft."""
    if export.kind == "peft":
        return "\n".join(["from peft import PeftModel",
                          f'for component in {list(export.adapter_configs)}:  # or "{output_dir}/ema/" + component '
                          "for the EMA adapter",
                          f'    PeftModel.from_pretrained(getattr(pipe, component), "{output_dir}/" + component)'])
    return f'pipe.load_lora_weights("{output_dir}")  # or "{output_dir}/ema" for the EMA adapter'


def component_config(model_class, args, subfolder):
    """The config of ``--pretrained_model_name_or_path``'s ``subfolder`` model as a dict (a hub id's: its config
    file alone), read with ``model_class.load_config`` before any weights load; empty where it cannot be read."""
    try:
        return dict(model_class.load_config(args.pretrained_model_name_or_path, subfolder=subfolder,
                                            revision=getattr(args, "revision", None)))
    except (OSError, ValueError):
        return {}


def add_max_sequence_length(group, help):
    """``--max_sequence_length``, the prompt's length in tokens; unset (None), the pipeline's own default applies
    (`max_sequence_length`). A family with a default of its own sets it with ``parser.set_defaults``."""
    group.add_argument("--max_sequence_length", type=int, default=None, help=help)


def check_max_sequence_length(args, limit=None, pipeline=None):
    """A positive ``--max_sequence_length``, or none (the pipeline's default); with ``limit``, at most the one that
    ``pipeline`` (a class name) refuses to exceed."""
    value = args.max_sequence_length
    if limit is None:
        require(value is None or value > 0, "--max_sequence_length", value, "a positive integer")
    else:
        require(value is None or 0 < value <= limit, "--max_sequence_length", value,
                f"a positive integer of at most {limit} ({pipeline}'s limit)")


def max_sequence_length(pipe, args, method="encode_prompt"):
    """``--max_sequence_length``, or where unset the default of the pipeline's ``method`` (``"__call__"`` where the
    pipeline passes its own to ``encode_prompt``)."""
    default = inspect.signature(getattr(pipe, method)).parameters["max_sequence_length"].default
    return args.max_sequence_length or default


def call_length_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with everywhere, where the pipeline's ``__call__`` passes it a length of its
    own: that ``max_sequence_length``, or ``--max_sequence_length``."""
    return {"max_sequence_length": max_sequence_length(pipe, args, "__call__")}


def prompt_length_settings(pipe, args):
    """What ``pipe.encode_prompt`` runs with, in training, validation and class images alike, where the prompt's
    length is all there is to set: ``--max_sequence_length``, or where unset the method's own default."""
    return {"max_sequence_length": max_sequence_length(pipe, args)}


def add_guidance_scale(group, help):
    """``--guidance_scale``: the guidance a guidance-distilled transformer embeds, in training and every render
    (3.5, upstream's default)."""
    group.add_argument("--guidance_scale", type=float, default=3.5, help=help)


def tokenize(tokenizer, texts):
    """Token ids padded to the tokenizer's maximum length, as the text encoders were trained."""
    return tokenizer(
        texts, max_length=tokenizer.model_max_length, padding="max_length", truncation=True, return_tensors="pt"
    ).input_ids


def stacked(rows, part):
    """Part ``part`` of every row, stacked into a batch."""
    return torch.stack([row[part] for row in rows])


def prompt_embeds(pipe, prompts, device, settings):
    """``(prompt_embeds,)`` of ``pipe.encode_prompt``, one row per prompt (no negative prompt: that is
    validation's)."""
    return pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=device, **settings)[:1]


def embeds_text_inputs(rows):
    """The model's text input for a batch whose rows are ``(prompt_embeds,)``."""
    return {"encoder_hidden_states": stacked(rows, 0)}


def masked_text_inputs(rows):
    """The transformer's text inputs for a batch whose rows are ``(embeddings, attention mask)``."""
    return {"encoder_hidden_states": stacked(rows, 0), "encoder_attention_mask": stacked(rows, 1)}


def call_kwargs(pipe, settings):
    """What every render (validation, class images) passes to the pipeline: the prompt settings."""
    return dict(settings)


def image_vae(pipe):
    """The VAE that encodes the training images: the pipeline's."""
    return pipe.vae


def scaled_latents(pipe, latents):
    """VAE latents as the model reads them: times the VAE's ``scaling_factor`` (the pipeline divides by it before
    decoding)."""
    return latents * pipe.vae.config.scaling_factor


def shifted_and_scaled_latents(pipe, latents):
    """VAE latents as the transformer reads them: shifted and scaled by the VAE's ``shift_factor`` and
    ``scaling_factor``, the inverse of what the pipeline does before decoding."""
    return (latents - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor


def standardised_latents(pipe, latents):
    """Video-VAE latents ``(B, C, frames, h, w)`` as the transformer reads them: standardised per channel with the
    VAE configuration's ``latents_mean`` and ``latents_std``, as the pipelines standardise them (sampling undoes it
    before decoding)."""
    config = pipe.vae.config
    shape = (1, config.z_dim, 1, 1, 1)
    mean, std = (torch.tensor(values).view(shape).to(latents.device, latents.dtype)
                 for values in (config.latents_mean, config.latents_std))
    return (latents - mean) / std


def batch_norm_standardised(pipe, patches):
    """Latent patches ``(B, C, h, w)`` standardised with the VAE's batch-norm running statistics (FLUX.2's VAE), as
    the pipelines encode images (and undo before decoding)."""
    bn, eps = pipe.vae.bn, pipe.vae.config.batch_norm_eps
    mean = bn.running_mean.view(1, -1, 1, 1).to(patches.device, patches.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(patches.device, patches.dtype)
    return (patches - mean) / std


def normalized_modes(pipe, parameters, normalized_latents):
    """A batch's references as the edit pipelines encode them, from their VAE latent distributions' ``parameters``
    (a list, one tensor per reference): the mode (the pipelines' ``sample_mode="argmax"``), then the family's
    ``normalized_latents``, as the target's."""
    return [normalized_latents(pipe, DiagonalGaussianDistribution(batch).mode()) for batch in parameters]


def output_as_is(pipe, output, latents):
    """The model's output, which is already what the loss compares, in the latents' own layout."""
    return output


def unpacked_prediction(pipe, output, latents):
    """The transformer's output tokens (2×2 patches, FLUX.1's packing) in the layout of the latents ``latents``:
    the velocity it predicts."""
    height, width = latents.shape[-2:]
    scale = pipe.vae_scale_factor  # the unpacking takes the image's size in pixels
    return pipe._unpack_latents(output, height * scale, width * scale, scale)


def check_packed_resolution(args, vae_class, scale_of, expected):
    """Fail in one line on a ``--resolution`` that the latents cannot pack into 2×2 patches: the VAE's scale is
    ``scale_of`` its configuration (``vae_class``'s, read from ``--pretrained_model_name_or_path`` without weights),
    which must load and be ``expected`` (what the flag names, in words)."""
    path, options = args.pretrained_model_name_or_path, {"revision": args.revision, "cache_dir": args.cache_dir}
    try:
        scale = scale_of(vae_class.load_config(path, subfolder="vae", **options))
    except (OSError, ValueError, KeyError):
        raise UsageError("--pretrained_model_name_or_path", path, expected) from None
    require(args.resolution % (2 * scale) == 0, "--resolution", args.resolution,
            f"a multiple of {2 * scale}: the VAE divides the size by {scale}, and the latents are packed in 2×2 "
            "patches")
