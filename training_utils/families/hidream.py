"""HiDream-I1: its conditioning and latent layout for training, taken from the pipeline itself
(`HiDreamImagePipeline`), and its LoRA layout in ComfyUI.

The HiDream transformer reads:

- ``encoder_hidden_states_t5``, ``encoder_hidden_states_llama3`` and ``pooled_embeds``: what ``pipe.encode_prompt``
  returns (`encode_prompts`): T5's hidden states; every hidden layer of Llama 3.1 Instruct but its embeddings,
  stacked layer-first (the transformer picks its ``llama_layers`` of them); and both CLIP encoders' pooled outputs,
  joined. Each is padded to ``--max_sequence_length`` (the pipeline's default unless set), and the same length goes
  to every render. Llama and its tokenizer come from their own flags, as upstream's script loads them (`llama`);
- ``hidden_states``: the VAE latents shifted and scaled by the VAE's configuration (`normalized_latents`), which
  the transformer cuts into 2×2 patches itself;
- ``timesteps``: the scheduler's timestep as it is (0 to 1000).

It predicts the opposite of flow matching's velocity: the pipeline negates its output before the scheduler steps,
and `prediction` does the same. In training mode the transformer routes each token through its experts so that
gradients reach them (in eval mode it routes without gradients) and returns its patches unfolded, which
`prediction` folds back into the latents' layout. Its mixture-of-experts router's auxiliary (load-balancing) loss is
not added to the loss, as upstream's script does not add it (diffusers' MoE layer computes it and drops it): the
router is frozen, and the adapter does not train it.

HiDream-I1 [full] samples with a flow-prediction UniPC scheduler shifted by its ``flow_shift``, [dev] and [fast]
with the flow-matching Euler scheduler and its ``shift``; training draws its noise levels with the same shift
(`training_noise_scheduler`; upstream's script always takes 3). ``HiDreamImagePipeline`` renders every image at the
area of its ``default_sample_size`` (1024² for HiDream-I1), whatever height and width it is asked for, which only set
the aspect ratio: `render_at_resolution` sets that area to ``--resolution``'s, so validation and class images are
rendered at the size training sees (at 1024, the pipeline's own).
"""

from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from ..memory_plan import meta_model, planning
from . import base
from .base import stacked
from .layout import Family, Rename

# upstream's defaults for the Llama flags: HiDream-I1's fourth text encoder, which its pipeline folders leave out.
LLAMA = "meta-llama/Meta-Llama-3.1-8B-Instruct"
# ComfyUI's HiDream model (comfy/ldm/hidream/model.py) names its modules as diffusers does (diffusers'
# convert_hidream_transformer_to_diffusers only strips the checkpoint's prefix).
COMFYUI_LAYOUT = (Rename(r"(.+)", r"\1"),)
FAMILY = Family("hidream", "HiDream-I1", ("HiDreamImagePipeline",), "transformer", {}, COMFYUI_LAYOUT)
check_args = base.check_max_sequence_length
prompt_settings = base.prompt_length_settings
call_kwargs = base.call_kwargs
image_vae = base.image_vae
normalized_latents = base.shifted_and_scaled_latents  # the transformer cuts them into 2×2 patches itself


def add_args(parser):
    """The prompt flags of the diffusers HiDream script, and where its Llama comes from."""
    group = parser.add_argument_group("HiDream")
    base.add_max_sequence_length(group, "tokens per prompt, of each text encoder (default: the pipeline's, 128)")
    group.add_argument("--pretrained_text_encoder_4_name_or_path", default=LLAMA,
                       help=f"the Llama model that is HiDream's fourth text encoder (default: {LLAMA})")
    group.add_argument("--pretrained_tokenizer_4_name_or_path", default=LLAMA,
                       help=f"its tokenizer (default: {LLAMA})")


def llama(args, weight_dtype, quantization=None):
    """``{"text_encoder_4", "tokenizer_4"}``: the Llama model and tokenizer of the flags, for `pipeline.load_pipeline`
    (the frozen model in ``weight_dtype``, quantised as ``quantization`` says of ``text_encoder_4``; on the meta device,
    from its config, for a run that only plans its memory: `memory_plan`)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    config = quantization.quant_mapping.get("text_encoder_4") if quantization is not None else None
    path = args.pretrained_text_encoder_4_name_or_path
    model = (meta_model(LlamaForCausalLM, path, subfolder="") if planning(args) else
             LlamaForCausalLM.from_pretrained(path, dtype=weight_dtype, quantization_config=config))
    return {"tokenizer_4": AutoTokenizer.from_pretrained(args.pretrained_tokenizer_4_name_or_path),
            "text_encoder_4": model}


def render_at_resolution(pipe, resolution):
    """Make ``pipe`` render at the area of ``resolution``² (see the module's docstring)."""
    pipe.default_sample_size = resolution // pipe.vae_scale_factor


def training_noise_scheduler(pipe):
    """The flow-matching scheduler that draws the training noise levels, shifted as the pipeline's scheduler samples:
    by a UniPC scheduler's ``flow_shift``, or a flow-matching scheduler's ``shift``."""
    config = pipe.scheduler.config
    shift = config.flow_shift if isinstance(pipe.scheduler, UniPCMultistepScheduler) else config.shift
    return FlowMatchEulerDiscreteScheduler.from_config(config, shift=shift)


def prompt_dependencies(pipe, settings):
    """What the prompts' rows depend on besides the text encoders' weights, for the disk cache's key: the encoding
    code, the four tokenizers and the settings."""
    return [encode_prompts, pipe.tokenizer, pipe.tokenizer_2, pipe.tokenizer_3, pipe.tokenizer_4, settings]


def encode_prompts(pipe, prompts, device, settings):
    """``(t5, llama, pooled)`` of ``pipe.encode_prompt``, a row per prompt: Llama's hidden layers come layer-first
    from it and are turned batch-first here (`text_inputs` turns them back)."""
    t5, _, llama_layers, _, pooled, _ = pipe.encode_prompt(list(prompts), device=device,
                                                           do_classifier_free_guidance=False, **settings)
    return t5, llama_layers.transpose(0, 1), pooled


def text_inputs(rows):
    """The transformer's text inputs for a batch whose samples have the `encode_prompts` rows ``rows``."""
    return {"encoder_hidden_states_t5": stacked(rows, 0),
            "encoder_hidden_states_llama3": stacked(rows, 1).transpose(0, 1),
            "pooled_embeds": stacked(rows, 2)}


def model_inputs(pipe, noisy_latents, timesteps, text):
    """All the transformer's inputs at the scheduler's ``timesteps``, as the pipeline's denoising loop passes
    them: the latents, and the timesteps as they are."""
    return {"hidden_states": noisy_latents, "timesteps": timesteps, **text}


def prediction(pipe, output, latents):
    """The velocity the pipeline steps the scheduler with: the transformer's training-mode output ``(B, C, tokens,
    patch²)``, its first tokens the latents' patches row by row (a non-square image's are padded), folded into the
    layout of ``latents`` and negated as the pipeline negates it."""
    batch, channels, height, width = latents.shape
    patch = pipe.transformer.config.patch_size
    rows, columns = height // patch, width // patch
    patches = output[:, :, :rows * columns].reshape(batch, channels, rows, columns, patch, patch)
    return -patches.permute(0, 1, 2, 4, 3, 5).reshape(batch, channels, height, width)
