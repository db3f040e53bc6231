"""Videos as validation writes them: an mp4 with a PNG strip of its frames beside it (`RenderedVideo`), the strip
being what grids and the model card show (`still`). A pipeline's video comes in whatever its ``output_type`` makes
(`video_frames` reads them all alike)."""

from pathlib import Path

import numpy as np
from PIL import Image


def video_frames(video):
    """One video of a pipeline's ``.frames``, whatever its ``output_type`` made it, as uint8 ``(frames, height,
    width, 3)``: a list of PIL images (``"pil"``), a NumPy array (``"np"``: ``(frames, height, width, 3)`` floats in
    [0, 1], or uint8), or a tensor (``"pt"``: ``(frames, 3, height, width)`` in [0, 1])."""
    if isinstance(video, (list, tuple)) and video and isinstance(video[0], Image.Image):
        return np.stack([np.asarray(frame.convert("RGB")) for frame in video])
    if hasattr(video, "detach"):  # a torch tensor, channels before the sides
        video = video.detach().float().cpu().numpy()
        if video.ndim == 4 and video.shape[1] in (1, 3) and video.shape[-1] not in (1, 3):
            video = video.transpose(0, 2, 3, 1)
    frames = np.asarray(video)
    if frames.ndim != 4 or frames.shape[-1] not in (1, 3):
        raise ValueError(f"a video of shape {frames.shape} is not (frames, height, width, channels)")
    if frames.dtype != np.uint8:
        frames = (np.clip(frames.astype(np.float32), 0, 1) * 255).round().astype(np.uint8)
    return np.repeat(frames, 3, axis=-1) if frames.shape[-1] == 1 else frames


class RenderedVideo:
    """A validation video (``frames``: one video of a pipeline's ``.frames``, read by `video_frames`) at ``fps``:
    saved as a PNG frame strip at the path it is given, and as an mp4 beside it; `still` is the strip, which grids
    and the model card show."""

    def __init__(self, frames, fps):
        self.frames = video_frames(frames)
        self.fps = fps

    @property
    def still(self):
        return Image.fromarray(np.concatenate(list(self.frames), axis=1))

    def save(self, path):
        self.still.save(path)
        write_mp4(Path(path).with_suffix(".mp4"), self.frames, self.fps)

    def convert(self, mode):
        return self.still.convert(mode)


def write_mp4(path, frames, fps):
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
