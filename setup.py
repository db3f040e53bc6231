from setuptools import find_packages, setup

setup(
    name="training_utils",
    version="0.1.0",
    description="Shared helpers for readable diffusers training scripts: one pipeline load, side-effect-free "
    "validation, and EMA of whatever is trained (LoRA adapters included).",
    packages=find_packages(include=["training_utils", "training_utils.*"]),
    # The pretrained tiny fixtures' committed weights (training_utils/testing/tiny/pretrain.py, pretrain_sd3.py).
    package_data={"training_utils.testing.tiny": ["pretrained/sd/*.json", "pretrained/sd/*/*",
                                                  "pretrained/sd3/*.json", "pretrained/sd3/*/*"]},
    python_requires=">=3.10",
    extras_require={
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "psutil", "torchao"],  # torchao: the int8 base runs on the CPU
        "quantization": ["torchao", "bitsandbytes"],
    },
    install_requires=[line.strip() for line in open("requirements.txt") if line.strip() and not line.startswith("#")],
)
