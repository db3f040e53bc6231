"""Videos as validation writes them: an mp4 with a PNG strip of its frames beside it (`RenderedVideo`), the strip
being what grids and the model card show (`still`)."""

from pathlib import Path

import numpy as np
from PIL import Image

# The frame rate of validation videos written by a pipeline that does not say (Wan renders 16 fps).
DEFAULT_FPS = 16


class RenderedVideo:
    """A validation video (``frames``: ``(frames, height, width, 3)`` in [0, 1]): saved as a PNG frame strip at
    the path it is given, and as an mp4 beside it; `still` is the strip, which grids and the model card show."""

    def __init__(self, frames, fps=DEFAULT_FPS):
        self.frames = (np.clip(np.asarray(frames, dtype=np.float32), 0, 1) * 255).round().astype(np.uint8)
        self.fps = fps

    @property
    def still(self):
        return Image.fromarray(np.concatenate(list(self.frames), axis=1))

    def save(self, path):
        self.still.save(path)
        write_mp4(Path(path).with_suffix(".mp4"), self.frames, self.fps)

    def convert(self, mode):
        return self.still.convert(mode)


def write_mp4(path, frames, fps=DEFAULT_FPS):
    """``frames`` (uint8 ``(frames, height, width, 3)``) as an H.264 mp4 at ``fps`` (sides padded to even)."""
    import av

    frames = np.asarray(frames)
    height, width = frames.shape[1] + frames.shape[1] % 2, frames.shape[2] + frames.shape[2] % 2
    frames = np.pad(frames, ((0, 0), (0, height - frames.shape[1]), (0, width - frames.shape[2]), (0, 0)), "edge")
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())


def still(image):
    """What a grid shows of a validation output: a video's frame strip, or the image itself."""
    return image.still if isinstance(image, RenderedVideo) else image
