"""The model families, a module each: what a training script must know of its model, in the same few functions with
the same signatures for every family, and the family's LoRA key layout for the UI tools.

A script names its family's module once and calls it where its model differs from the others' (``flux2`` here;
the transformer scripts' loops differ only in that name)::

    settings = flux2.prompt_settings(pipe, args)      # how prompts are encoded: training, validation, class images
    call_kwargs = flux2.call_kwargs(pipe, settings)   # what every render passes to the pipeline
    rows = flux2.encode_prompts(pipe, prompts, device, settings)  # batch-first parts, a row per prompt (cached)
    dependencies = flux2.prompt_dependencies(pipe, settings)      # what the rows depend on, for the disk cache
    vae = flux2.image_vae(pipe)                       # the VAE as `frozen_encoders.FrozenEncoders` drives it (images in)
    latents = flux2.normalized_latents(pipe, vae_latents)          # the latents as the model reads them
    text = flux2.text_inputs(rows_of_the_batch)      # a batch's text inputs, from its samples' rows
    output = transformer(**flux2.model_inputs(pipe, noisy_latents, timesteps, text))  # all the model's inputs
    velocity = flux2.prediction(pipe, output, latents)  # the output mapped onto the loss target's layout and sign

``model_inputs`` takes the batch's text inputs and returns the model's whole keyword set, because some inputs
depend on both the text and the latents (Ideogram 4's positions and segments).

Families with flags of their own add and check them (``add_args(parser)``, ``check_args(args)``, before any weights
load); those whose text encoders can train take the wrapped encoders in ``encode_prompts(...,
text_encoders={component: module})``. Each module's ``FAMILY`` (`layout.Family`) names the pipeline classes whose
LoRAs it lays out, exactly, and its ComfyUI layout (``COMFYUI_LAYOUT``, the original release's module names).

The protocol is stated once, as code: `protocol.ImageFamily` (the functions above, with their signatures) and
`protocol.EditFamily` for families whose pipelines take reference images (``model_inputs(..., references=())``,
``reference_layout``, ``check_reference_size``, ``reference_latents``); `protocol.OPTIONAL` names the parameters a
function may add (``text_encoders``). ``tests/test_families.py`` checks every family module against them.

Families share code in one way: where a family's protocol function is exactly a shared one, the module binds the
name to it by assignment at its top (``image_vae = base.image_vae``; ``normalized_latents = flux.normalized_latents``
in FLUX.1 Kontext), so a script still calls ``flux_kontext.image_vae(pipe)``. `base` holds what several families do
alike (the VAE as it is, the renders' settings, shifting and scaling or standardising latents, the shared flags
``--max_sequence_length`` and ``--guidance_scale``, each declared there only, and the small text helpers); a family
that does more than another family's function writes its own function and calls that one inside.

A new family adds its module here and registers it in `registry` (`FAMILIES`). Importing one family module
imports no other but those it shares functions with, and little of the rest of the package: the registry, which
imports them all, is for the code that looks families up by name.
"""
