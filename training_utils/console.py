"""What the libraries print that says nothing about a run, kept off the console.

Importing diffusers imports transformers, which imports torchao where it is installed, whether or not a quantised
base is asked for; on the way they log lines that a user can do nothing about: torchao's kernels built for other
GPUs, torch's deprecation notice to torchao's authors, diffusers' failed import of torchao tensor types (we never
unpickle them), transformers' PIL fallback without torchvision, and diffusers' note on an empty list of float32
modules. Each is dropped on the logger that writes it, by its exact message; anything else those loggers say still
shows. `training_utils/__init__.py` installs the filters, so importing any of the package before diffusers (every
script's first import, every ``python -m training_utils...`` command) installs them before the first line is logged.
"""

import logging
import re

# {logger name: the messages of it that say nothing about a run}
KNOWN_NOISE = {
    "torchao": [r"Failed to load \S*/torchao/_C\w*\.\S*\.so: Could not load this library"],
    "torch.utils._pytree": [r"<enum '\w+'> is an Enum subclass and is now natively supported by torch\.compile as an "
                            r"opaque value type\. Calling register_constant\(\) on Enum subclasses is deprecated"],
    "diffusers.quantizers.torchao.torchao_quantizer": [r"Unable to import `torchao` Tensor objects\."],
    "transformers.utils.import_utils": [r"`\w+ImageProcessor` requires torchvision \(not installed\); falling back to "
                                        r"`\w+ImageProcessorPil` for backward compatibility\."],
    "diffusers.models.modeling_utils": [r"There are modules in \w+ that should be kept in float32: \[\]\. "],
}


class DropMessages(logging.Filter):
    """Drops the records whose message starts with a match of one of ``patterns``."""

    def __init__(self, patterns):
        super().__init__()
        self.pattern = re.compile("|".join(f"(?:{pattern})" for pattern in patterns))

    def filter(self, record):
        return self.pattern.match(record.getMessage()) is None


def quiet_known_noise():
    """Install the `KNOWN_NOISE` filters on their loggers (once, however often called)."""
    for name, patterns in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(installed, DropMessages) for installed in logger.filters):
            logger.addFilter(DropMessages(patterns))
