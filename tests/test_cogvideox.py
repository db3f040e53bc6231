"""training_utils.families.cogvideox: CogVideoX's prompt encoding, latent layout, transformer inputs, first-frame
conditioning and v-prediction loss are the pipelines' own.

The central check: sampling with a transformer that predicts exactly the training target (the velocity of the
clean latents, through the training loss's own conversion) ends on those clean latents, in CogVideoX 1.0's layout and
in 1.5 image-to-video's (pairs of latent frames, the first frame's latents on the channels), the transformer's other
inputs at every step being those `model_inputs` makes."""

import pytest
import torch
from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution
from PIL import Image

from training_utils.families import cogvideox
from training_utils.testing.tiny.cogvideox import (LATENT_CHANNELS, cogvideox_scheduler, tiny_cogvideox_transformer,
                                                   tiny_cogvideox_vae)
from training_utils.testing.tiny.parts import tiny_t5_encoder, tiny_t5_tokenizer

PROMPTS = ["a red circle on a white background", "a blue square"]


@pytest.fixture(scope="module")
def pipes():
    from diffusers import CogVideoXImageToVideoPipeline, CogVideoXPipeline

    tokenizer = tiny_t5_tokenizer()
    parts = {"tokenizer": tokenizer, "text_encoder": tiny_t5_encoder(len(tokenizer)),
             "scheduler": cogvideox_scheduler()}
    pipes = {"t2v": CogVideoXPipeline(vae=tiny_cogvideox_vae(), transformer=tiny_cogvideox_transformer(), **parts),
             "i2v": CogVideoXImageToVideoPipeline(
                 vae=tiny_cogvideox_vae(invert_scale_latents=True), transformer=tiny_cogvideox_transformer(
                     in_channels=2 * LATENT_CHANNELS, patch_size_t=2, ofs_embed_dim=4), **parts)}
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes


def test_prompts_encode_as_the_pipeline_encodes_them_when_it_samples(pipes):
    pipe = pipes["t2v"]
    settings = cogvideox.prompt_settings(pipe, None)
    assert settings == {"max_sequence_length": 226}
    assert pipe.transformer.config.max_text_seq_length == 226
    with torch.no_grad():
        rows, = cogvideox.encode_prompts(pipe, PROMPTS, "cpu", settings)
        expected, _ = pipe.encode_prompt(PROMPTS, do_classifier_free_guidance=False, device="cpu")
    assert rows.shape == (2, 226, 64) and torch.equal(rows, expected) and not torch.allclose(rows[0], rows[1])


def test_latents_are_laid_out_frames_first_scaled_and_padded_to_whole_temporal_patches(pipes):
    latents = torch.randn(2, LATENT_CHANNELS, 3, 4, 4)  # (B, C, frames, H, W) as the VAE gives them
    plain = cogvideox.normalized_latents(pipes["t2v"], latents)
    assert torch.equal(plain, latents.permute(0, 2, 1, 3, 4) * pipes["t2v"].vae.config.scaling_factor)
    paired = cogvideox.normalized_latents(pipes["i2v"], latents)  # 1.5: 3 latent frames read as 2 pairs
    assert paired.shape == (2, 4, LATENT_CHANNELS, 4, 4)
    assert torch.equal(paired[:, 1:], plain) and torch.equal(paired[:, 0], plain[:, 0])
    assert cogvideox.normalized_latents(pipes["i2v"], latents[:, :, :2]).shape[1] == 2


def test_a_velocity_of_the_training_target_has_no_loss(pipes):
    """The scripts' loss, as upstream's: the clean latents the velocity implies (``get_velocity``), weighted."""
    noise_scheduler = cogvideox.training_noise_scheduler(pipes["t2v"])
    latents, noise = torch.randn(2, 3, LATENT_CHANNELS, 4, 4), torch.randn(2, 3, LATENT_CHANNELS, 4, 4)
    timesteps = torch.tensor([10, 990])
    noisy = noise_scheduler.add_noise(latents, noise, timesteps)
    alphas = noise_scheduler.alphas_cumprod[timesteps].float().view(-1, 1, 1, 1, 1)
    velocity = alphas.sqrt() * noise - (1 - alphas).sqrt() * latents
    predicted = noise_scheduler.get_velocity(velocity, noisy, timesteps)
    torch.testing.assert_close(predicted, latents, atol=1e-5, rtol=0)
    assert not torch.allclose(noise_scheduler.get_velocity(noise, noisy, timesteps), latents, atol=1e-2)


def oracle(pipe, clean, seen):
    """A forward for ``pipe.transformer`` that predicts the velocity of ``clean`` (the training target) from the
    noisy latents it is given, checking its other inputs against `cogvideox.model_inputs`."""
    channels = clean.shape[2]

    def forward(hidden_states, encoder_hidden_states, timestep, image_rotary_emb=None, ofs=None, return_dict=True,
                **_):
        noisy = hidden_states[:, :, :channels]
        text = cogvideox.text_inputs(list(encoder_hidden_states))
        expected = cogvideox.model_inputs(pipe, hidden_states, timestep, text)
        for ours, theirs in zip(expected["image_rotary_emb"], image_rotary_emb):
            assert torch.equal(ours, theirs)
        assert (ofs is None) == (expected["ofs"] is None) and (ofs is None or torch.equal(ofs, expected["ofs"]))
        seen.append(hidden_states)
        alphas = pipe.scheduler.alphas_cumprod[timestep.long()].view(-1, 1, 1, 1, 1)
        noise = (noisy - alphas.sqrt() * clean) / (1 - alphas).sqrt()
        return (alphas.sqrt() * noise - (1 - alphas).sqrt() * clean,)

    return forward


@pytest.mark.parametrize("name", ["t2v", "i2v"])
def test_sampling_towards_the_training_target_ends_on_the_clean_latents(pipes, monkeypatch, name):
    pipe = pipes[name]
    frames = 4 if name == "i2v" else 3  # 9 frames: 3 latent frames, in pairs for 1.5 (one more in front)
    clean = torch.randn(1, frames, LATENT_CHANNELS, 4, 4, generator=torch.Generator().manual_seed(0))
    seen = []
    monkeypatch.setattr(pipe.transformer, "forward", oracle(pipe, clean, seen))
    image = {"image": Image.new("RGB", (32, 32), (200, 30, 30))} if name == "i2v" else {}
    latents = pipe(prompt=PROMPTS[0], num_frames=9, height=32, width=32, num_inference_steps=4, guidance_scale=1.0,
                   output_type="latent", generator=torch.Generator().manual_seed(1), **image).frames
    assert len(seen) == 4 and seen[0].shape[1] == frames
    torch.testing.assert_close(latents, clean, atol=1e-4, rtol=1e-4)


def test_the_first_frames_latents_are_laid_out_as_the_pipeline_lays_out_its_image(pipes, monkeypatch):
    """Noise augmentation off and the VAE's mode for its samples: `image_to_video_conditioning` is exactly the
    image latents that the 1.5 pipeline puts beside its noisy latents (divided by the scaling factor, then zeros)."""
    pipe = pipes["i2v"]
    monkeypatch.setattr(cogvideox, "IMAGE_NOISE_LOG_SIGMA", (float("-inf"), 0.5))
    monkeypatch.setattr(DiagonalGaussianDistribution, "sample", lambda self, generator=None: self.mode())
    seen = []
    monkeypatch.setattr(pipe.transformer, "forward", oracle(pipe, torch.zeros(1, 4, LATENT_CHANNELS, 4, 4), seen))
    image = Image.new("RGB", (32, 32), (200, 30, 30))
    pipe(image=image, prompt=PROMPTS[0], num_frames=9, height=32, width=32, num_inference_steps=1,
         guidance_scale=1.0, output_type="latent")
    first_frame = torch.tensor([200, 30, 30], dtype=torch.float32).view(1, 3, 1, 1).expand(1, 3, 32, 32) / 127.5 - 1
    conditioning = cogvideox.image_to_video_conditioning(pipe, first_frame, torch.zeros(1, 4, LATENT_CHANNELS, 4, 4))
    theirs = seen[0][:, :, LATENT_CHANNELS:]
    torch.testing.assert_close(conditioning["image_latents"], theirs, atol=1e-5, rtol=1e-5)
    assert theirs[:, 0].abs().sum() > 0 and not theirs[:, 1:].any()
    dropped = cogvideox.image_to_video_conditioning(pipe, first_frame, torch.zeros(1, 4, LATENT_CHANNELS, 4, 4), 1.0)
    assert not dropped["image_latents"].any()  # --noised_image_dropout 1: no first frame


def test_renders_lengths_whose_latent_frames_the_vae_decodes_as_asked():
    assert [frames for frames in range(1, 50, 4) if cogvideox.renders(frames)] == [1, 9, 17, 25, 33, 41, 49]
