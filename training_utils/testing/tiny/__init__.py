"""Tiny offline fixtures: pipelines and datasets small enough to train on a CPU in seconds.

Nothing here touches the network. Every fixture is built from random weights with a fixed seed
and saved with ``save_pretrained``, so the scripts load it exactly as they load a hub model::

    python -m training_utils.testing.tiny --output_dir tiny          # builds every fixture
    python -m training_utils.testing.tiny --output_dir tiny sd shapes

Each family's pipelines are built in a module of their own (`sd`, `sdxl`, `sd3`, `flux` (with Kontext), `flux2`,
`z_image`, `qwen_image`, `qwen_image_edit`, `chroma`, `flux2_dev`, `krea2`, `sana`, `lumina2`, `hidream`, `ideogram4`,
`wan`, `ltx`, `ltx2`, `hunyuan_video15`, `cogview4`, `cogvideox`, `cosmos`: Cosmos Predict 2.5 and clips in its layout,
`ddpm`: the unconditional DDPM, pixel space, `kandinsky2_2`: its decoder and prior, `amused`: aMUSEd's masked tokens,
`llada2`: a causal LM for masked text diffusion, `vqgan`: a VQModel, its discriminator's config, a VGG) from the shared
building blocks of `parts` (offline tokenizers, text encoders, a VAE, a UNet); the datasets are `data`'s and `video`'s
(and `ddpm`'s image classes).
Two fixtures are not random: `sd`'s ``sd_pretrained``, a tiny SD 1.x trained on the shapes (by `pretrain`), and
`sd3`'s ``sd3_pretrained``, a tiny SD3 trained on them (by `pretrain_sd3`), their weights committed. Each module
lists its builders, ``build_<name>(path)``, in a ``FIXTURES`` dict, merged here: a new family adds its module and one
line below.
"""

import argparse
from pathlib import Path

from . import (amused, chroma, cogvideox, cogview4, cosmos, data, ddpm, flux, flux2, flux2_dev, hidream, hunyuan_video15,
               ideogram4, kandinsky2_2, krea2, llada2, ltx, ltx2, lumina2, qwen_image, qwen_image_edit, sana, sd, sd3,
               sdxl, video, vqgan, wan, z_image)

FIXTURES = {**sd.FIXTURES, **sdxl.FIXTURES, **sd3.FIXTURES, **flux.FIXTURES, **flux2.FIXTURES, **z_image.FIXTURES,
            **qwen_image.FIXTURES, **qwen_image_edit.FIXTURES, **chroma.FIXTURES, **flux2_dev.FIXTURES,
            **krea2.FIXTURES, **sana.FIXTURES, **lumina2.FIXTURES, **hidream.FIXTURES, **ideogram4.FIXTURES,
            **wan.FIXTURES, **ltx.FIXTURES, **ltx2.FIXTURES, **hunyuan_video15.FIXTURES, **cogview4.FIXTURES,
            **cosmos.FIXTURES, **cogvideox.FIXTURES, **ddpm.FIXTURES, **kandinsky2_2.FIXTURES, **amused.FIXTURES,
            **llada2.FIXTURES, **vqgan.FIXTURES, **data.FIXTURES, **video.FIXTURES}


def build(output_dir, names=None):
    """Build the named fixtures (all by default) under ``output_dir``; returns ``{name: path}``."""
    paths = {}
    for name in names or FIXTURES:
        paths[name] = Path(output_dir) / name
        FIXTURES[name](paths[name])
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="tiny", help="where the fixtures go (default: ./tiny)")
    parser.add_argument("names", nargs="*", help=f"fixtures to build, of {', '.join(FIXTURES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.names) - set(FIXTURES))
    if unknown:
        parser.error(f"unknown fixture {unknown[0]!r}; expected one of {', '.join(FIXTURES)}")
    for name, path in build(args.output_dir, args.names).items():
        print(f"{name}: {path}")
