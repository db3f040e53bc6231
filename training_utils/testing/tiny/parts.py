"""The building blocks that the tiny pipelines share: offline tokenizers built from in-memory vocabularies, text
encoders, a VAE and a UNet of a few thousand parameters each, with a fixed seed.

Every tokenizer is real (byte-level BPE for CLIP and Qwen, Unigram for T5) and holds the words that the tiny data's
captions and the tests' prompts use as whole tokens, so that distinct prompts tokenize to distinct ids.
"""

import json

import torch

from .data import BACKGROUNDS, COLORS, SEED, SHAPES

# Every word a caption or a demo prompt uses gets a whole-word token, so distinct prompts
# tokenize to distinct ids instead of collapsing into unknown tokens.
EXTRA_WORDS = ("a", "an", "on", "of", "the", "background", "photo", "small", "big", "shape", "sks", "dog", "in")


def vocabulary():
    """The words of the tiny data's captions and the tests' prompts."""
    return list(COLORS) + list(BACKGROUNDS) + list(SHAPES) + list(EXTRA_WORDS)


def _bytes_to_unicode():
    """The byte-to-printable-character table of GPT-2/CLIP byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return [chr(c) for c in codes]


def tiny_clip_tokenizer(words=None, model_max_length=77):
    """A real byte-level BPE CLIP tokenizer whose vocabulary holds ``words`` as whole tokens.

    Every byte has a token, so any text tokenizes; the listed words merge into single tokens.
    """
    from transformers import CLIPTokenizer

    words = sorted(set(words if words is not None else vocabulary()))
    byte_chars = _bytes_to_unicode()
    tokens = list(byte_chars) + [c + "</w>" for c in byte_chars]
    merges = []
    for word in words:
        # Merge left to right: "red" -> "r e", "re d</w>" so each prefix is a vocabulary entry.
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        merged = pieces[0]
        for piece in pieces[1:]:
            rule = (merged, piece)
            if rule not in merges:
                merges.append(rule)
            merged += piece
            if merged not in tokens:
                tokens.append(merged)
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: index for index, token in enumerate(tokens)}
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=model_max_length)


def tiny_clip_text_encoder(vocab_size, with_projection=False, hidden_size=32, seed=SEED, max_position_embeddings=77):
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=max_position_embeddings,
        projection_dim=hidden_size,
        bos_token_id=vocab_size - 2,
        eos_token_id=vocab_size - 1,
        pad_token_id=vocab_size - 1,
    )
    model_class = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return model_class(config).eval()


def tiny_t5_tokenizer(words=None):
    """A real T5 (Unigram) tokenizer: whole-word pieces for ``words``, single letters for the rest."""
    from transformers import T5Tokenizer

    words = sorted(set(words if words is not None else vocabulary()))
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -1.0) for word in words]
    pieces += [(chr(c), -5.0) for c in range(ord("a"), ord("z") + 1)]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=256)


def tiny_t5_encoder(vocab_size, d_model=64, seed=SEED):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, decoder_start_token_id=0)
    return T5EncoderModel(config).eval()


# Qwen3's chat format for one user turn, with the empty thinking block its template writes when thinking is off
# (Flux2KleinPipeline wraps each prompt so before encoding it).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


def tiny_qwen_tokenizer(words=None):
    """A real byte-level BPE Qwen2 tokenizer (Qwen3's) with Qwen3's special tokens and chat format, whose
    vocabulary holds ``words`` as whole tokens, with and without a leading space.

    Every byte has a token, so any text tokenizes. BPE trained on the words alone learns exactly the merges
    that join each of them into one token (hand-written merges would split words that contain other words).
    """
    from tokenizers import pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    words = sorted(set(words if words is not None else vocabulary()))
    special_tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    backend = Qwen2Tokenizer().backend_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=4096, show_progress=False, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([form for word in words for form in (word, " " + word)], trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    return Qwen2Tokenizer(vocab=model["vocab"], merges=[tuple(merge) for merge in model["merges"]],
                          additional_special_tokens=special_tokens[1:], chat_template=QWEN3_CHAT_TEMPLATE)


def tiny_qwen3_text_encoder(tokenizer, num_hidden_layers=28, hidden_size=16, seed=SEED):
    """A Qwen3 causal LM, FLUX.2 [klein]'s text encoder class. Deep enough for the hidden layers that
    Flux2KleinPipeline reads by default (9, 18 and 27), narrow enough to cost nothing."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=32,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, max_position_embeddings=512, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=None, eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    return Qwen3ForCausalLM(config).eval()



def tiny_llama3_tokenizer(words=None):
    """A real byte-level BPE tokenizer as Llama 3's (a ``PreTrainedTokenizerFast`` adding ``<|begin_of_text|>``,
    ending turns with ``<|eot_id|>``), whose vocabulary holds ``words`` as whole tokens, with and without a leading
    space; every byte has a token, so any text tokenizes."""
    from tokenizers import pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

    words = sorted(set(words if words is not None else vocabulary()))
    begin, end_of_text, end_of_turn = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
    backend = Qwen2Tokenizer().backend_tokenizer  # byte-level BPE with GPT-2's splitting, as Llama 3's
    trainer = trainers.BpeTrainer(vocab_size=4096, show_progress=False, special_tokens=[begin, end_of_text,
                                                                                        end_of_turn],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([form for word in words for form in (word, " " + word)], trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{begin} $A", pair=f"{begin} $A {begin} $B", special_tokens=[(begin, backend.token_to_id(begin))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=begin, eos_token=end_of_turn,
                                   model_max_length=131072)


def tiny_glm_tokenizer(words=None):
    """A real byte-level BPE tokenizer as GLM-4's (a ``PreTrainedTokenizerFast`` writing ``[gMASK]<sop>`` before
    the text, padding at the front with ``<|endoftext|>``), whose vocabulary holds ``words`` as whole tokens, with
    and without a leading space; every byte has a token, so any text tokenizes."""
    from tokenizers import pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Tokenizer

    words = sorted(set(words if words is not None else vocabulary()))
    end_of_text, mask, start = "<|endoftext|>", "[gMASK]", "<sop>"
    backend = Qwen2Tokenizer().backend_tokenizer  # byte-level BPE with GPT-2's splitting, as GLM-4's
    trainer = trainers.BpeTrainer(vocab_size=4096, show_progress=False, special_tokens=[end_of_text, mask, start],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator([form for word in words for form in (word, " " + word)], trainer=trainer)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{mask} {start} $A", pair=f"{mask} {start} $A $B",
        special_tokens=[(token, backend.token_to_id(token)) for token in (mask, start)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=end_of_text, pad_token=end_of_text,
                                   padding_side="left", model_max_length=128000)


def tiny_glm_text_encoder(tokenizer, num_hidden_layers=2, hidden_size=16, seed=SEED):
    """A GLM model (CogView4's text encoder class, GLM-4's), without the language-model head."""
    from transformers import GlmConfig, GlmModel

    torch.manual_seed(seed)
    config = GlmConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=32, head_dim=8,
                       num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                       eos_token_id=tokenizer.eos_token_id, attn_implementation="eager")
    return GlmModel(config).eval()


def tiny_llama_text_encoder(tokenizer, num_hidden_layers=2, hidden_size=16, seed=SEED):
    """A Llama causal LM (HiDream's fourth text encoder class, Llama 3.1 Instruct's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=32,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id,
                         attn_implementation="eager")
    return LlamaForCausalLM(config).eval()


def tiny_gemma_tokenizer(words=None, texts=()):
    """A real Gemma tokenizer (byte-fallback BPE on whole prompts, spaces as "▁"), adding <bos>, whose vocabulary
    holds ``words`` and the words of ``texts`` (a pipeline's instructions) as whole tokens, with and without a
    leading "▁"; any other text falls back to its characters, or to their bytes."""
    import string

    from tokenizers import trainers
    from transformers import GemmaTokenizer

    words = sorted(set(words if words is not None else vocabulary()) | {word for text in texts
                                                                       for word in text.split()})
    backend = GemmaTokenizer().backend_tokenizer
    trainer = trainers.BpeTrainer(vocab_size=4096, show_progress=False,
                                  special_tokens=["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"],
                                  initial_alphabet=list("\u2581" + string.printable.strip()))
    # Trained on the words one at a time, so that no merge joins two words.
    backend.train_from_iterator([form for word in words for form in (word, " " + word)], trainer=trainer)
    model = json.loads(backend.to_str())["model"]
    vocab = model["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    return GemmaTokenizer(vocab=vocab, merges=[tuple(merge) for merge in model["merges"]], add_bos_token=True)


def tiny_gemma2_text_encoder(tokenizer, num_hidden_layers=2, hidden_size=16, seed=SEED):
    """A Gemma 2 model (SANA's and Lumina 2's text encoder class), without the language-model head."""
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=32, head_dim=8,
                          num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
                          max_position_embeddings=2048, pad_token_id=tokenizer.pad_token_id,
                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                          attn_implementation="eager")
    return Gemma2Model(config).eval()

def tiny_vae(seed=SEED, **overrides):
    """A VAE that halves the resolution (real SD VAEs divide by 8), with SD's 4 latent channels."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    config = dict(
        block_out_channels=(16, 32),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
        latent_channels=4,
        norm_num_groups=8,
        sample_size=32,
    )
    config.update(overrides)
    return AutoencoderKL(**config)


def tiny_unet(cross_attention_dim=32, seed=SEED, **overrides):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    config = dict(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=cross_attention_dim,
        attention_head_dim=(2, 4),
        norm_num_groups=8,
    )
    config.update(overrides)
    return UNet2DConditionModel(**config)


def sd_inference_scheduler():
    """The scheduler SD 1.x checkpoints ship (PNDM); it keeps state between steps, like many do."""
    from diffusers import PNDMScheduler

    return PNDMScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        num_train_timesteps=1000,
        skip_prk_steps=True,
        set_alpha_to_one=False,
        steps_offset=1,
    )


def sd_components():
    """What SD 1.x and SDXL pipelines share: the VAE, a CLIP text encoder and its tokenizer."""
    tokenizer = tiny_clip_tokenizer()
    return {"vae": tiny_vae(), "text_encoder": tiny_clip_text_encoder(len(tokenizer)), "tokenizer": tokenizer}
