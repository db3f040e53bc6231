"""Tiny FLUX.2 [dev]: a FLUX.2 transformer with its guidance embedding, FLUX.2's VAE and a Mistral 3 text encoder
with a real Mistral tokenizer and chat template, in the released folder's layout: its ``tokenizer`` is Mistral's
processor (``PixtralProcessor``: the tokenizer and Pixtral's image processor), as diffusers'
``scripts/convert_flux2_to_diffusers.py`` saves black-forest-labs/FLUX.2-dev's (``AutoProcessor`` of
Mistral-Small-3.1-24B-Instruct-2503)."""

import json
import re
from pathlib import Path

import torch

from .flux2 import tiny_flux2_vae
from .parts import SEED, vocabulary

# Mistral Small 3.1's chat format, as Flux2Pipeline renders a conversation (a system turn with its system message,
# then the prompt as a user turn; each turn's content a list of typed parts): the beginning-of-text token, then
# each turn between its control tokens.
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text = message['content'] %}"
    "{%- else %}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{ '[INST]' + text + '[/INST]' }}"
    "{%- else %}{{ text + eos_token }}{%- endif %}{%- endfor %}"
)
MISTRAL_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                          "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
# The Pixtral vision tower's patches, as the tiny text encoder's (its processor lays images out in them).
VISION_PATCH_SIZE = 8


def tiny_mistral_tokenizer(words=None):
    """A real byte-level BPE tokenizer (Mistral's tekken kind) with Mistral's special tokens and chat format, whose
    vocabulary holds ``words`` as whole tokens, with and without a leading space: by default the tiny data's words
    and those of FLUX.2's system message, which every prompt is encoded after. Every byte has a token, so any text
    tokenizes."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if words is None:
        words = vocabulary() + re.findall(r"\w+|[^\w\s]", SYSTEM_MESSAGE)
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, show_progress=False, special_tokens=MISTRAL_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([form for word in sorted(set(words)) for form in (word, " " + word)], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", additional_special_tokens=MISTRAL_SPECIAL_TOKENS[4:],
                                  chat_template=MISTRAL_CHAT_TEMPLATE)


def tiny_mistral3_text_encoder(tokenizer, num_hidden_layers=30, hidden_size=16, seed=SEED):
    """A Mistral 3 model (language model and a one-layer Pixtral vision tower, which text prompts never run),
    FLUX.2 [dev]'s text encoder class. Deep enough for the hidden layers that Flux2Pipeline reads by default (10, 20
    and 30), narrow enough to cost nothing."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    ids = {name: tokenizer.convert_tokens_to_ids(token)
           for name, token in (("bos_token_id", "<s>"), ("eos_token_id", "</s>"), ("pad_token_id", "<pad>"))}
    torch.manual_seed(seed)
    config = Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=hidden_size,
                         intermediate_size=32, num_hidden_layers=num_hidden_layers, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, sliding_window=None,
                         **ids),
        vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=32, image_size=32, patch_size=VISION_PATCH_SIZE, num_channels=3),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), vision_feature_layer=-1, **ids)
    return Mistral3ForConditionalGeneration(config).eval()


def build_flux2_dev(path):
    """A FLUX.2 [dev] pipeline: a FLUX.2 transformer (one double-stream and two single-stream blocks, with the
    guidance embedding of the guidance-distilled [dev]), FLUX.2's VAE, a Mistral 3 text encoder whose three default
    hidden layers make the transformer's text features, a real Mistral tokenizer, and FLUX.2's resolution-shifted
    flow-matching scheduler."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel

    tokenizer = tiny_mistral_tokenizer()
    text_encoder = tiny_mistral3_text_encoder(tokenizer)
    vae = tiny_flux2_vae()
    torch.manual_seed(SEED)
    transformer = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * vae.config.latent_channels, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=3 * text_encoder.config.text_config.hidden_size, timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=True,
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
        max_image_seq_len=4096, time_shift_type="exponential",
    )
    Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                  transformer=transformer).save_pretrained(path)
    _save_the_tokenizer_as_the_released_processor(Path(path))


def _save_the_tokenizer_as_the_released_processor(path):
    """The folder's ``tokenizer`` as the released one: Mistral's ``PixtralProcessor`` (beside the tokenizer's files,
    Pixtral's image processor and the processor's settings), so that it loads as FLUX.2-dev's does (transformers 5
    imports ``PixtralProcessor`` only beside torchvision)."""
    from transformers import PixtralImageProcessorPil

    image_processor = PixtralImageProcessorPil(patch_size=VISION_PATCH_SIZE, size={"longest_edge": 32})
    image_processor.save_pretrained(path / "tokenizer")
    processor = {"processor_class": "PixtralProcessor", "patch_size": VISION_PATCH_SIZE, "spatial_merge_size": 1,
                 "image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}
    (path / "tokenizer" / "processor_config.json").write_text(json.dumps(processor, indent=2))
    index = json.loads((path / "model_index.json").read_text())
    index["tokenizer"] = ["transformers", "PixtralProcessor"]
    (path / "model_index.json").write_text(json.dumps(index, indent=2))


FIXTURES = {"flux2_dev": build_flux2_dev}
