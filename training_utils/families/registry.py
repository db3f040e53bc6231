"""Every family's LoRA layout (`layout.Family`), by name, and looked up by pipeline class: what the LoRA
converter and ``--export_formats`` need to know of a family, without its training code's callers importing them all."""

from . import (chroma, cogvideox, cogview4, cosmos, flux, flux2, flux2_dev, flux_kontext, hidream, hunyuan_video15,
               ideogram4, krea2, ltx, ltx2, lumina2, qwen_image, qwen_image_edit, sana, sd, sd3, sdxl, wan, z_image)

FAMILIES = {module.FAMILY.name: module.FAMILY for module in (sd, sdxl, sd3, flux, flux2, z_image, qwen_image, chroma,
                                                             flux2_dev, krea2, sana, lumina2, hidream, ideogram4,
                                                             wan, flux_kontext, qwen_image_edit, cogview4, cosmos,
                                                             cogvideox, ltx2, ltx, hunyuan_video15)}


def family_of(name):
    """The `layout.Family` named ``name``, or whose pipelines include the class named ``name`` (exactly); None if
    none does."""
    if name in FAMILIES:
        return FAMILIES[name]
    return next((family for family in FAMILIES.values() if name in family.pipelines), None)


def formats_for(name):
    """The layouts besides diffusers' that apply to LoRAs of the pipeline class (or family) named ``name``: () for
    an unknown one."""
    family = family_of(name)
    return family.formats if family else ()
