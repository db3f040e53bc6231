"""Peak memory of loading and preparing a real-size pipeline for LoRA training, as the scripts do it.

    python -m tests.benchmarks.memory --model sdxl --quantize_base none int8 nf4 --json build/bench/memory-sdxl.json
    python -m tests.benchmarks.memory --model sd35m [--with_t5] --quantize_base none int8
    python -m tests.benchmarks.memory --model wan21_1.3b --quantize_base none int8   # also wan22_ti2v_5b

What it builds. The real architecture from its real config (SDXL base; SD3.5-medium, with T5-XXL only
under ``--with_t5``), random weights, saved once as a diffusers pipeline folder under ``--fixtures_dir``
in bf16, the dtype the run loads them in (as hub repositories ship fp16/bf16 variants). Modules are made
on the meta device and filled tensor by tensor, so building takes seconds per billion parameters and
holds one component at a time. Tokenizers are `training_utils.testing.tiny`'s: they do not weigh anything.

What it measures. Each ``--quantize_base`` runs in a fresh process (peaks must not mix), which does
what `train_text_to_image_lora_sdxl.py` and `train_dreambooth_lora_sd3.py` do in their steps 2 and 3:
`quantization_config`, `load_pipeline`, `add_adapter` (a rank-16 LoRA, `ATTENTION_PROJECTIONS`),
`prepare_components`, gradient checkpointing, `make_ema` (``--use_ema``), with bf16 mixed precision.

* Host: a background thread reads ``/proc/self/status`` every few milliseconds and keeps, per step
  (phase), the peaks of anonymous memory (RssAnon: what the process allocated itself, torch's CPU
  tensors included) and of file-backed memory (RssFile: pages of mapped files; safetensors files are
  memory-mapped, so weights used in place from the file count here, and the kernel can drop and
  re-read them under pressure). Total RSS alone would mix the two. The kernel's own high-water mark
  (VmHWM, reset after the imports) checks the sampled peak total.
* On the CPU, every tensor is then read once (phase "first_use", after load + prepare), as the first
  forward passes would: what is resident once the weights are used.
* The lower bound of what load + prepare must hold: the frozen tensors in their dtype (a quantised
  weight counts its int8 data and scales), the trained (LoRA) tensors in fp32 and their fp32 EMA.
  A LoRA step adds AdamW's two fp32 states per trained tensor (its bound), plus gradients and
  activations that no bound counts.
* On CUDA, also the peak accelerator memory (``torch.cuda.max_memory_allocated``) during load +
  prepare and during one LoRA step at 1024x1024, batch 1, gradient checkpointing, bf16 autocast,
  AdamW: random latents and text embeddings of the script's shapes. The Wan models (Wan 2.1 T2V 1.3B with its
  UMT5-XXL text encoder, Wan 2.2 TI2V-5B, as `train_text_to_video_lora_wan.py` loads them) take one step per
  clip length instead: 480x832, 33 and 81 frames, 512 prompt tokens.

Targets: on the host (CPU), peak anonymous memory <= 1.3 x (lower bound + anonymous memory after the
imports); on CUDA, peak accelerator memory during load + prepare <= 1.05 x the resident frozen,
trained and EMA bytes, and an SDXL rank-16 LoRA step at 1024x1024 with ``--quantize_base int8`` <= 10 GB.
GB here is 10^9 bytes. Not part of the test suite.
"""

import argparse
import contextlib
import json
import multiprocessing
import os
import threading
import time
import types
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Tuple

import torch
import torch.nn.functional as F
from diffusers import StableDiffusionXLPipeline

from training_utils.adapters.config import check_adapter_args, fill_adapter_settings
from training_utils.args import add_lora_args, training_parser
from training_utils.errors import UsageError
from training_utils.quantization import check_quantization_args

from tests.benchmarks.unet_step import CONFIGS

RESOLUTION = 1024
MIXED_PRECISION = "bf16"
SCHEMES = ("none", "int8", "nf4")
LOAD_PREPARE = ("load_pipeline", "add_lora", "prepare_components", "make_ema")  # the scripts' steps 2 and 3
TARGETS = {"host_anon_ratio": 1.3, "accelerator_load_ratio": 1.05, "sdxl_int8_step_bytes": 10e9}
# One file per module up to this size, as the hub's fp16 variants are (T5-XXL, 9.5 GB, in two).
MAX_SHARD_SIZE = "6GB"


# --- the real architectures, built on the meta device -------------------------------------------------------

def clip_l(model_class):
    """CLIP ViT-L/14's text encoder (SDXL's and SD3's first)."""
    from transformers import CLIPTextConfig

    return model_class(CLIPTextConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, projection_dim=768, hidden_act="quick_gelu",
                                      vocab_size=49408, max_position_embeddings=77))


def clip_big_g():
    """OpenCLIP ViT-bigG/14's text encoder with its projection (SDXL's and SD3's second)."""
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    return CLIPTextModelWithProjection(CLIPTextConfig(
        hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
        projection_dim=1280, hidden_act="gelu", vocab_size=49408, max_position_embeddings=77))


def t5_xxl():
    """T5 v1.1 XXL's encoder (SD3's third text encoder, 4.7B parameters)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24, vocab_size=32128,
                                   feed_forward_proj="gated-gelu", is_encoder_decoder=False))


def vae(**config):
    """The SD VAE family: 8x downsampling, 128..512 channels."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                         up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, sample_size=1024,
                         force_upcast=True, **config)


def sdxl_components():
    """SDXL base's components; its modules on the meta device."""
    from diffusers import EulerDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel

    from training_utils.testing.tiny.parts import tiny_clip_tokenizer

    with torch.device("meta"):
        modules = {
            "unet": UNet2DConditionModel(**CONFIGS["sdxl"]),
            "vae": vae(latent_channels=4, scaling_factor=0.13025),
            "text_encoder": clip_l(CLIPTextModel),
            "text_encoder_2": clip_big_g(),
        }
    tokenizer = tiny_clip_tokenizer()
    return {
        **modules,
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer,
        "scheduler": EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                            timestep_spacing="leading", steps_offset=1),
    }


def sd35m_components():
    """SD3.5-medium's components; its modules on the meta device."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection

    from training_utils.testing.tiny.parts import tiny_clip_tokenizer, tiny_t5_tokenizer

    with torch.device("meta"):
        modules = {
            "transformer": SD3Transformer2DModel(
                sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
                num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                pooled_projection_dim=2048, pos_embed_max_size=384, dual_attention_layers=tuple(range(13)),
                qk_norm="rms_norm"),
            "vae": vae(latent_channels=16, use_quant_conv=False, use_post_quant_conv=False, scaling_factor=1.5305,
                       shift_factor=0.0609),
            "text_encoder": clip_l(CLIPTextModelWithProjection),
            "text_encoder_2": clip_big_g(),
            "text_encoder_3": t5_xxl(),
        }
    tokenizer = tiny_clip_tokenizer()
    return {
        **modules,
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer,
        "tokenizer_3": tiny_t5_tokenizer(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=3.0),
    }


def sdxl_step_inputs(pipe, device):
    size = RESOLUTION // pipe.vae_scale_factor
    unet = pipe.unet
    return {
        "sample": torch.randn(1, unet.config.in_channels, size, size, device=device),
        "timestep": torch.tensor([500], device=device),
        "encoder_hidden_states": torch.randn(1, 77, unet.config.cross_attention_dim, device=device),
        "added_cond_kwargs": {
            "text_embeds": torch.randn(1, pipe.text_encoder_2.config.projection_dim, device=device),
            "time_ids": torch.tensor([[RESOLUTION, RESOLUTION, 0, 0, RESOLUTION, RESOLUTION]], dtype=torch.float32,
                                     device=device),
        },
    }


def sd3_step_inputs(pipe, device):
    size = RESOLUTION // pipe.vae_scale_factor
    transformer = pipe.transformer
    # The script's prompt: 77 CLIP tokens, then --max_sequence_length (77) T5 tokens.
    return {
        "hidden_states": torch.randn(1, transformer.config.in_channels, size, size, device=device),
        "timestep": torch.tensor([500.0], device=device),
        "encoder_hidden_states": torch.randn(1, 77 + 77, transformer.config.joint_attention_dim, device=device),
        "pooled_projections": torch.randn(1, transformer.config.pooled_projection_dim, device=device),
    }


def umt5_xxl():
    """UMT5-XXL's encoder (Wan's text encoder, 5.7B parameters with its 256k-token vocabulary)."""
    from transformers import UMT5Config, UMT5EncoderModel

    return UMT5EncoderModel(UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                       num_heads=64, relative_attention_num_buckets=32,
                                       relative_attention_max_distance=128, feed_forward_proj="gated-gelu"))


def wan_components(transformer, vae, flow_shift, expand_timesteps=False):
    """A Wan pipeline's components (its modules on the meta device): UMT5-XXL, and the transformer and VAE of
    the hub's configs."""
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel

    from training_utils.testing.tiny.parts import tiny_t5_tokenizer

    with torch.device("meta"):
        modules = {"transformer": WanTransformer3DModel(**transformer), "vae": AutoencoderKLWan(**vae),
                   "text_encoder": umt5_xxl()}
    return {**modules, "tokenizer": tiny_t5_tokenizer(), "expand_timesteps": expand_timesteps,
            "scheduler": UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                                 flow_shift=flow_shift)}


WAN_BLOCKS = {"patch_size": (1, 2, 2), "attention_head_dim": 128, "text_dim": 4096, "freq_dim": 256, "num_layers": 30,
              "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads", "eps": 1e-6, "rope_max_seq_len": 1024}


def wan21_components():
    """Wan 2.1 T2V 1.3B (Wan-AI/Wan2.1-T2V-1.3B-Diffusers): 12 heads, FFN 8960, the Wan 2.1 VAE (16 channels)."""
    return wan_components({**WAN_BLOCKS, "num_attention_heads": 12, "ffn_dim": 8960, "in_channels": 16,
                           "out_channels": 16}, {}, flow_shift=3.0)


# The Wan 2.2 VAE of TI2V-5B as diffusers converts it: ``vae22_diffusers_config`` in huggingface/diffusers'
# scripts/convert_wan_to_diffusers.py (48 latent channels, 2x2 pixel patches, 16x in space and 4x in time, the
# latents' per-channel mean and std; the rest AutoencoderKLWan's defaults: dim_mult [1, 2, 4, 4], 2 blocks per level;
# its clip_output=False is left out: diffusers 0.42's AutoencoderKLWan has no such argument).
WAN22_VAE = {
    "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
    "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
    "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4,
    "latents_mean": [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813,
                     0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108,
                     -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313,
                     -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944,
                     0.3573, -0.0548, -0.1681, -0.0667],
    "latents_std": [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
                    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
                    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
                    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744],
}


def wan22_ti2v_components():
    """Wan 2.2 TI2V-5B (Wan-AI/Wan2.2-TI2V-5B-Diffusers): 24 heads, FFN 14336, the Wan 2.2 VAE (`WAN22_VAE`),
    per-token timesteps, flow shift 5 (the conversion script's for TI2V)."""
    return wan_components({**WAN_BLOCKS, "num_attention_heads": 24, "ffn_dim": 14336, "in_channels": 48,
                           "out_channels": 48}, WAN22_VAE, flow_shift=5.0, expand_timesteps=True)


def wan_step_inputs(pipe, device, num_frames=81, height=480, width=832):
    """A 480p clip's latents of ``num_frames`` frames, its timestep (per token with TI2V's ``expand_timesteps``)
    and 512 tokens of prompt, as `train_text_to_video_lora_wan.py` gives them."""
    from training_utils.families import wan

    transformer, spatial = pipe.transformer, pipe.vae_scale_factor_spatial
    latents = torch.randn(1, transformer.config.in_channels, (num_frames - 1) // pipe.vae_scale_factor_temporal + 1,
                          height // spatial, width // spatial, device=device)
    text = {"encoder_hidden_states": torch.randn(1, 512, transformer.config.text_dim, device=device)}
    return wan.model_inputs(pipe, latents, torch.tensor([500.0], device=device), text)


@dataclass(frozen=True)
class Model:
    pipeline_class: str
    base: str  # the frozen model the LoRA trains on (the one --quantize_base quantises)
    text_encoders: Tuple[str, ...]
    components: Callable[[], dict]
    step_inputs: Callable
    optional: Tuple[str, ...] = ()  # components left out unless --with_t5
    steps: dict = None  # one LoRA step per {label: step_inputs keyword arguments} (video: per clip length)


MODELS = {
    "sdxl": Model("StableDiffusionXLPipeline", "unet", ("text_encoder", "text_encoder_2"), sdxl_components,
                  sdxl_step_inputs),
    "sd35m": Model("StableDiffusion3Pipeline", "transformer", ("text_encoder", "text_encoder_2", "text_encoder_3"),
                   sd35m_components, sd3_step_inputs, optional=("text_encoder_3", "tokenizer_3")),
    "wan21_1.3b": Model("WanPipeline", "transformer", ("text_encoder",), wan21_components, wan_step_inputs,
                        steps={"33 frames": {"num_frames": 33}, "81 frames": {"num_frames": 81}}),
    "wan22_ti2v_5b": Model("WanPipeline", "transformer", ("text_encoder",), wan22_ti2v_components, wan_step_inputs,
                           steps={"33 frames": {"num_frames": 33}, "81 frames": {"num_frames": 81}}),
}


# --- the fixture: a pipeline folder of random weights ---------------------------------------------------------

def fill_random(module, dtype, generator):
    """Give a meta-device ``module`` CPU storage in ``dtype`` and random values (normal, std 0.02), tensor by
    tensor: a real init (kaiming) of billions of parameters takes minutes on a few cores."""
    module.to(dtype=dtype).to_empty(device="cpu")
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02, generator=generator)
            else:
                tensor.zero_()
    return module


def build_fixture(model, path, dtype, with_optional):
    """The pipeline folder of ``model`` at ``path`` (model_index.json and one folder per component), random
    weights saved in ``dtype``; components already there are kept, so it is built once and reused."""
    import diffusers

    path = Path(path)
    components = model.components()  # modules on the meta device: nothing is allocated until filled
    missing = [name for name in components if hasattr(components[name], "save_pretrained")  # not a setting
               and not (path / name).is_dir() and (with_optional or name not in model.optional)]
    if not missing:
        return
    path.mkdir(parents=True, exist_ok=True)
    getattr(diffusers, model.pipeline_class)(**components).save_config(path)  # model_index.json
    generator = torch.Generator().manual_seed(0)
    for name in missing:
        started = time.perf_counter()
        component = components.pop(name)
        if isinstance(component, torch.nn.Module):
            fill_random(component, dtype, generator)
            # diffusers and transformers models both write safetensors by default
            component.save_pretrained(path / f"{name}.partial", max_shard_size=MAX_SHARD_SIZE)
        else:
            component.save_pretrained(path / f"{name}.partial")
        (path / f"{name}.partial").rename(path / name)  # complete folders only: an interrupted build resumes
        del component
        print(f"built {path / name} in {time.perf_counter() - started:.0f} s", flush=True)


# --- host memory, sampled -------------------------------------------------------------------------------------

def resident_memory():
    """This process's resident bytes now: anonymous, file-backed, shared (``/proc/self/status``)."""
    fields = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in fields:
                values[fields[key]] = int(rest.split()[0]) * 1024
    values["total"] = values["anon"] + values["file"] + values["shmem"]
    return values


def kernel_peak_total():
    """The kernel's exact high-water mark of total RSS (VmHWM) since `reset_kernel_peak`."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_kernel_peak():
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # "5" resets the peak RSS (Documentation/filesystems/proc.rst)


class HostMemorySampler:
    """Samples `resident_memory` on a background thread; ``with sampler.phase(name):`` keeps the block's
    peaks (anonymous, file-backed, total) and its duration under ``name``."""

    def __init__(self, interval=0.003):
        self.interval = interval
        self.phases = {}
        self.current = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._stopped.set()
        self._thread.join()

    def _run(self):
        while not self._stopped.wait(self.interval):
            self.sample()

    def sample(self):
        now = resident_memory()
        phase = self.current
        if phase is not None:
            phase["samples"] += 1
            for kind in ("anon", "file", "total"):
                phase[f"peak_{kind}"] = max(phase[f"peak_{kind}"], now[kind])
        return now

    @contextlib.contextmanager
    def phase(self, name):
        start = resident_memory()
        self.current = {"peak_anon": start["anon"], "peak_file": start["file"], "peak_total": start["total"],
                        "samples": 0}
        started = time.perf_counter()
        try:
            yield
        finally:
            end = self.sample()
            self.current.update(seconds=time.perf_counter() - started, anon_at_end=end["anon"],
                                file_at_end=end["file"])
            self.phases[name], self.current = self.current, None


# --- one configuration, in its own process -------------------------------------------------------------------

def script_args(pipeline_path, scheme, rank):
    """The flags a script would parse for this run (the scripts' own parser, so every default is theirs)."""
    parser = training_parser("memory benchmark")
    add_lora_args(parser, StableDiffusionXLPipeline)
    argv = ["--pretrained_model_name_or_path", str(pipeline_path), "--rank", str(rank), "--use_ema",
            "--mixed_precision", MIXED_PRECISION, "--gradient_checkpointing"]
    if scheme != "none":
        argv += ["--quantize_base", scheme]
    args = parser.parse_args(argv)
    check_adapter_args(args)
    fill_adapter_settings(args)
    return args


def storage_tensors(tensor):
    """The plain tensors that hold ``tensor``'s data: itself, or a quantised tensor subclass's (torchao's) inner
    tensors (int8 data, scales)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        return [inner for name in names for inner in storage_tensors(getattr(tensor, name))]
    return [tensor]


def module_tensors(pipe):
    """Every parameter and buffer of the pipeline's modules."""
    from training_utils.pipeline import modules_of

    return [tensor for module in modules_of(pipe).values() for tensor in [*module.parameters(), *module.buffers()]]


def held_bytes(pipe):
    """``(frozen, trained)``: bytes of the frozen tensors (parameters and buffers) of the pipeline's modules in
    their dtype, and of the trained tensors (those that require grad)."""
    frozen = trained = 0
    for tensor in module_tensors(pipe):
        size = sum(inner.numel() * inner.element_size() for inner in storage_tensors(tensor))
        if tensor.requires_grad:
            trained += size
        else:
            frozen += size
    return frozen, trained


def read_every_tensor(pipe):
    """Read each tensor once, as the first forward and encoding passes would: memory-mapped weights become
    resident (file-backed) only when used."""
    with torch.no_grad():
        for tensor in module_tensors(pipe):
            for inner in storage_tensors(tensor):
                inner.sum()


def lora_step_peak(model, pipe, args, parameters, ema, device, weight_dtype, **sizes):
    """Peak accelerator bytes of one LoRA training step: forward under autocast, loss, backward, AdamW step
    (its states appear here), EMA update. ``sizes`` go to the model's ``step_inputs``."""
    from training_utils.optimization import make_optimizer

    denoiser = getattr(pipe, model.base)
    denoiser.train()
    optimizer = make_optimizer(args, parameters, num_processes=1)
    inputs = model.step_inputs(pipe, device, **sizes)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.autocast(device.type, dtype=weight_dtype):
        prediction = denoiser(**inputs, return_dict=False)[0]
    loss = F.mse_loss(prediction.float(), torch.randn_like(prediction, dtype=torch.float32))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    ema.update(1)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device), loss.item()


def measure(model_name, pipeline_path, scheme, with_optional, rank):
    """Load and prepare ``model_name`` as its script does, in this (fresh) process; the figures as a dict."""
    import importlib

    import diffusers

    from training_utils.ema import make_ema
    from training_utils.adapters.config import adapter_config
    from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_adapter
    from training_utils.pipeline import load_pipeline, prepare_components, trainable_parameters, weight_dtype_for
    from training_utils.quantization import PACKAGES, quantization_config

    model = MODELS[model_name]
    args = script_args(pipeline_path, scheme, rank)
    # Import now whatever loading would import later, so that the baseline holds the libraries' whole weight.
    if scheme != "none":
        importlib.import_module(PACKAGES[scheme])
    left_out = {} if with_optional else dict.fromkeys(model.optional)
    index = json.loads((Path(pipeline_path) / "model_index.json").read_text())
    for name, entry in index.items():
        if name not in left_out and isinstance(entry, list) and entry[0] in ("diffusers", "transformers"):
            getattr(importlib.import_module(entry[0]), entry[1])
    pipeline_class = getattr(diffusers, model.pipeline_class)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.type == "cuda"
    weight_dtype = weight_dtype_for(MIXED_PRECISION)
    figures = {"model": model_name, "quantize_base": scheme, "device": torch.cuda.get_device_name(device)
               if on_cuda else "cpu", "left_out": sorted(left_out), "rank": rank,
               # glibc's malloc settings change how much freed memory stays anonymous (see the README)
               "malloc_env": {name: value for name, value in os.environ.items() if name.startswith("MALLOC_")}}
    with HostMemorySampler() as sampler:
        baseline = resident_memory()
        reset_kernel_peak()
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        with sampler.phase("load_pipeline"):
            quantization = quantization_config(args, weight_dtype, base=[model.base],
                                               text_encoders=list(model.text_encoders))
            pipe = load_pipeline(pipeline_class, args, weight_dtype, quantization=quantization, **left_out)
        denoiser = getattr(pipe, model.base)
        with sampler.phase("add_lora"):
            # the SD3 script names every matching module in full (lora_target_modules): the same modules
            add_adapter(denoiser, adapter_config(args, ATTENTION_PROJECTIONS))
        trained = {model.base: denoiser}
        with sampler.phase("prepare_components"):
            prepare_components(pipe, trained, device, weight_dtype)
            denoiser.enable_gradient_checkpointing()
            parameters = trainable_parameters(trained)
        with sampler.phase("make_ema"):
            # make_ema reads only the accelerator's device
            ema = make_ema(args, parameters, types.SimpleNamespace(device=device))
        kernel_peak = kernel_peak_total()
        if on_cuda:
            figures["accelerator_peak_load_prepare"] = torch.cuda.max_memory_allocated(device)
            steps = {label: lora_step_peak(model, pipe, args, parameters, ema, device, weight_dtype, **sizes)
                     for label, sizes in (model.steps or {"": {}}).items()}
            figures["accelerator_peak_step"], figures["step_loss"] = max(steps.values())
            if model.steps:
                figures["accelerator_peak_steps"] = {label: peak for label, (peak, _) in steps.items()}
        else:  # (on CUDA, moving the weights to the device has read them)
            with sampler.phase("first_use"):
                read_every_tensor(pipe)

    phases = sampler.phases
    frozen, trained_bytes = held_bytes(pipe)
    figures.update(
        base_parameters=sum(p.numel() for p in denoiser.parameters()),
        trained_parameters=sum(p.numel() for p in parameters.values()),
        baseline_anon=baseline["anon"], baseline_file=baseline["file"], baseline_total=baseline["total"],
        peak_anon=max(phases[name]["peak_anon"] for name in LOAD_PREPARE),
        peak_file=max(phases[name]["peak_file"] for name in LOAD_PREPARE),
        peak_total=max(phases[name]["peak_total"] for name in LOAD_PREPARE),
        kernel_peak_total=kernel_peak,
        frozen_bytes=frozen, trained_bytes=trained_bytes, ema_bytes=ema.num_bytes,
        lower_bound_load_prepare=frozen + trained_bytes + ema.num_bytes,
        lower_bound_step=frozen + trained_bytes + ema.num_bytes + 2 * trained_bytes,
        load_prepare_seconds=sum(phases[name]["seconds"] for name in LOAD_PREPARE),
        phases=phases,
    )
    bound = figures["lower_bound_load_prepare"]
    figures["host_anon_ratio"] = figures["peak_anon"] / (bound + baseline["anon"])
    if on_cuda:
        figures["accelerator_load_ratio"] = figures["accelerator_peak_load_prepare"] / bound
    else:
        used = phases["first_use"]
        figures["used_anon"], figures["used_file"] = used["anon_at_end"], used["file_at_end"]
        figures["used_total_ratio"] = used["peak_total"] / (bound + baseline["total"])
    return figures


def run_configuration(model_name, pipeline_path, scheme, with_optional, rank):
    """`measure` in a fresh process; a skipped configuration says why (e.g. nf4 without CUDA)."""
    args = script_args(pipeline_path, scheme, rank)
    try:
        check_quantization_args(args)
    except UsageError as error:
        return {"model": model_name, "quantize_base": scheme, "skipped": str(error)}
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        figures = pool.submit(measure, model_name, str(pipeline_path), scheme, with_optional, rank).result()
    figures["process_seconds"] = time.perf_counter() - started
    return figures


# --- report ---------------------------------------------------------------------------------------------------

def gb(value):
    return f"{value / 1e9:.2f}"


def verdict(value, target):
    return f"{value:.2f} {'ok' if value <= target else 'over'}"


def markdown(results):
    measured = [figures for figures in results if "skipped" not in figures]
    lines = [
        "Host memory during load + prepare (GB = 10^9 bytes). bound: frozen tensors in their dtype + trained fp32 + "
        "EMA fp32. anon ratio: peak RssAnon / (bound + RssAnon after the imports), target <= "
        f"{TARGETS['host_anon_ratio']}. used: resident after every tensor was read once (CPU), anonymous + "
        "file-backed; used ratio: that total over (bound + total RSS after the imports).",
        "",
        "| model | `--quantize_base` | baseline anon | peak anon | peak file-backed | peak total (kernel) | frozen "
        "| trained + EMA | bound | anon ratio | used | used ratio | load + prepare s | process s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for figures in results:
        if "skipped" in figures:
            lines.append(f"| {figures['model']} | {figures['quantize_base']} | skipped: {figures['skipped']} |"
                         + " |" * 11)
            continue
        used, used_ratio = "–", "–"
        if "used_anon" in figures:
            used = f"{gb(figures['used_anon'])} + {gb(figures['used_file'])}"
            used_ratio = f"{figures['used_total_ratio']:.2f}"
        lines.append(
            f"| {figures['model']} | {figures['quantize_base']} | {gb(figures['baseline_anon'])} "
            f"| {gb(figures['peak_anon'])} | {gb(figures['peak_file'])} | {gb(figures['peak_total'])} "
            f"({gb(figures['kernel_peak_total'])}) | {gb(figures['frozen_bytes'])} "
            f"| {gb(figures['trained_bytes'] + figures['ema_bytes'])} | {gb(figures['lower_bound_load_prepare'])} "
            f"| {verdict(figures['host_anon_ratio'], TARGETS['host_anon_ratio'])} | {used} | {used_ratio} "
            f"| {figures['load_prepare_seconds']:.0f} | {figures['process_seconds']:.0f} |")
    lines += ["", "Where it goes, step by step (host, GB):", "",
              "| model | `--quantize_base` | step | seconds | anon at end | peak anon | file-backed at end "
              "| peak file-backed | samples |", "|---|---|---|---|---|---|---|---|---|"]
    for figures in measured:
        for name, phase in figures["phases"].items():
            lines.append(f"| {figures['model']} | {figures['quantize_base']} | {name} | {phase['seconds']:.1f} "
                         f"| {gb(phase['anon_at_end'])} | {gb(phase['peak_anon'])} | {gb(phase['file_at_end'])} "
                         f"| {gb(phase['peak_file'])} | {phase['samples']} |")
    on_cuda = [figures for figures in measured if "accelerator_peak_load_prepare" in figures]
    if on_cuda:
        lines += ["", f"Accelerator (GB; max_memory_allocated). Load + prepare over its bound (frozen + trained + "
                  f"EMA, all resident), target <= {TARGETS['accelerator_load_ratio']}; the LoRA step "
                  f"({RESOLUTION}x{RESOLUTION}, batch 1, gradient checkpointing) beside its bound (+ AdamW "
                  "states; gradients and activations come on top); SDXL int8 target <= "
                  f"{gb(TARGETS['sdxl_int8_step_bytes'])} GB.", "",
                  "| model | `--quantize_base` | peak load + prepare | bound | ratio | peak LoRA step | step bound |",
                  "|---|---|---|---|---|---|---|"]
        for figures in on_cuda:
            step = gb(figures["accelerator_peak_step"])
            if "accelerator_peak_steps" in figures:
                step = ", ".join(f"{label}: {gb(peak)}" for label, peak in figures["accelerator_peak_steps"].items())
            if figures["model"] == "sdxl" and figures["quantize_base"] == "int8":
                step += " ok" if figures["accelerator_peak_step"] <= TARGETS["sdxl_int8_step_bytes"] else " over"
            lines.append(
                f"| {figures['model']} | {figures['quantize_base']} | {gb(figures['accelerator_peak_load_prepare'])} "
                f"| {gb(figures['lower_bound_load_prepare'])} "
                f"| {verdict(figures['accelerator_load_ratio'], TARGETS['accelerator_load_ratio'])} "
                f"| {step} | {gb(figures['lower_bound_step'])} |")
    return "\n".join(lines)


# --- FSDP2: what each process holds of a sharded transformer ---------------------------------------------------

# The FLUX.2 [klein] 4B transformer's config (diffusers' conversion script); Z-Image's defaults are the 6B model's.
KLEIN_4B = {"patch_size": 1, "in_channels": 128, "num_layers": 5, "num_single_layers": 20, "attention_head_dim": 128,
            "num_attention_heads": 24, "joint_attention_dim": 7680, "timestep_guidance_channels": 256,
            "mlp_ratio": 3.0, "axes_dims_rope": (32, 32, 32, 32), "rope_theta": 2000, "eps": 1e-6,
            "guidance_embeds": False}
# Each with its DreamBooth script's default --lora_layers.
SHARDED_MODELS = {"flux2_klein_4b": ("Flux2Transformer2DModel", KLEIN_4B,
                                     "to_k,to_q,to_v,to_out.0,to_qkv_mlp_proj,attn.to_out"),
                  "z_image_6b": ("ZImageTransformer2DModel", {}, "to_k,to_q,to_v,to_out.0")}


def sharded_worker(rank, processes, model_name, lora_rank, port, results):
    """One process of an FSDP2 run: the transformer built on the meta device in bf16 (its real config, no weights:
    the sizes are what matter, and the 4B and 6B models would not fit this machine twice), a LoRA of ``lora_rank``,
    AdamW, accelerate's prepare through `make_accelerator`'s path, and the EMA; puts what it holds in ``results``."""
    import diffusers

    from training_utils.adapters.config import adapter_config
    from training_utils.ema import EMA
    from training_utils.adapters.injection import add_adapter, linear_layers_named
    from training_utils.pipeline import trainable_parameters
    from training_utils.sharding.fsdp2 import enable_fsdp2_on_cpu, fsdp2_plugin, held_bytes

    os.environ["ACCELERATE_USE_CPU"] = "1"
    if processes > 1:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(processes),
                           "LOCAL_WORLD_SIZE": str(processes), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"})
    from accelerate import Accelerator
    plugin = fsdp2_plugin()
    accelerator = Accelerator(mixed_precision="bf16", fsdp_plugin=plugin, device_placement=False)  # meta stays
    enable_fsdp2_on_cpu(accelerator, plugin)
    class_name, config, layers = SHARDED_MODELS[model_name]
    with torch.device("meta"):
        transformer = getattr(diffusers, class_name)(**config).to(torch.bfloat16)
    transformer.requires_grad_(False)
    lora = types.SimpleNamespace(adapter="lora", rank=lora_rank, lora_alpha=lora_rank, lora_dropout=0.0,
                                 use_dora=False, init_lora_weights=True)
    add_adapter(transformer, adapter_config(lora, linear_layers_named(transformer, layers.split(","))))
    trained = {"transformer": transformer}
    for parameter in trainable_parameters(trained).values():  # fp32, as `prepare_components` makes them
        parameter.data = parameter.data.float()
    optimizer = torch.optim.AdamW(trainable_parameters(trained).values())
    transformer, optimizer = accelerator.prepare(transformer, optimizer)
    ema = EMA(trainable_parameters(trained), decay=0.999)
    results[rank] = held_bytes(trained, [ema])
    accelerator.wait_for_everyone()
    accelerator.end_training()


def sharded_held_bytes(model_name, processes, lora_rank):
    """``[held_bytes per process]`` of the transformer sharded over ``processes`` CPU processes (gloo)."""
    from training_utils.testing.launch import free_port
    with multiprocessing.Manager() as manager:
        results = manager.dict()
        port = free_port()
        context = multiprocessing.get_context("spawn")
        workers = [context.Process(target=sharded_worker, args=(rank, processes, model_name, lora_rank, port, results))
                   for rank in range(processes)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if any(worker.exitcode for worker in workers):
            raise RuntimeError(f"an FSDP2 process of {model_name} failed")
        return [dict(results[rank]) for rank in range(processes)]


def sharded_table(model_names, process_counts, lora_rank):
    """The markdown table of what each process holds, GB, and the figures by model and process count."""
    figures = {name: {count: sharded_held_bytes(name, count, lora_rank) for count in process_counts}
               for name in model_names}
    lines = ["| model (meta device, bf16, LoRA r16 fp32) | processes | per process: frozen GB | trained MB | EMA MB "
             "| share of one process's (frozen / trained / EMA) |", "|---|---|---|---|---|---|"]
    for name, by_count in figures.items():
        alone = by_count.get(1, [None])[0]
        for count, held in by_count.items():
            most = {kind: max(process[kind] for process in held) for kind in ("frozen", "trained", "ema")}
            share = (" / ".join(f"{most[kind] / alone[kind]:.2f}" for kind in most) if alone else "–")
            lines.append(f"| {name} | {count} | {gb(most['frozen'])} | {most['trained'] / 1e6:.1f} | "
                         f"{most['ema'] / 1e6:.1f} | {share} |")
    return "\n".join(lines), figures


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fsdp2", nargs="+", choices=sorted(SHARDED_MODELS), default=None,
                        help="instead: what each process holds of these transformers with 1 and 2 FSDP2 processes")
    parser.add_argument("--model", choices=sorted(MODELS), default="sdxl")
    parser.add_argument("--with_t5", action="store_true", help="sd35m: also build and load T5-XXL (4.7B, 9.5 GB)")
    parser.add_argument("--quantize_base", nargs="+", choices=SCHEMES, default=["none", "int8"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--fixtures_dir", default="build/bench/memory-models")
    parser.add_argument("--json", default=None, help="also write the figures here (and the table beside it, .md)")
    options = parser.parse_args(argv)
    if options.fsdp2:
        table, figures = sharded_table(options.fsdp2, (1, 2), options.rank)
        print(table)
        if options.json:
            Path(options.json).parent.mkdir(parents=True, exist_ok=True)
            Path(options.json).write_text(json.dumps(figures, indent=2))
            Path(options.json).with_suffix(".md").write_text(table + "\n")
        return figures

    model = MODELS[options.model]
    pipeline_path = Path(options.fixtures_dir) / options.model
    build_fixture(model, pipeline_path, torch.bfloat16, options.with_t5)
    results = [run_configuration(options.model, pipeline_path, scheme, options.with_t5, options.rank)
               for scheme in options.quantize_base]
    table = markdown(results)
    print(table)
    if options.json:
        Path(options.json).parent.mkdir(parents=True, exist_ok=True)
        Path(options.json).write_text(json.dumps(results, indent=2))
        Path(options.json).with_suffix(".md").write_text(table + "\n")
    return results


if __name__ == "__main__":
    main()
