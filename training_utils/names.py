"""The names of the files and folders that runs write and read: their one definition, in a module that imports
nothing, so that any module can use them without importing what writes them."""

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
# Components that a pipeline's ``save_lora_weights`` has no argument for but whose ``load_lora_weights`` loads a LoRA
# of another component's layout into, with a flag: Wan 2.2's low-noise expert, whose LoRA is a transformer LoRA that
# ``load_lora_weights(path, load_into_transformer_2=True)`` loads. Written as that component's; beside a LoRA of
# that component, in a subfolder named after it (`AdapterExport.files`).
SAVED_AS = {"transformer_2": "transformer"}
# A component's adapter in peft's own format (LoKr, LoHa, OFT) is a folder holding this file.
PEFT_CONFIG_NAME = "adapter_config.json"
EMA_FOLDER = "ema"
SNAPSHOT_DIR = "posthoc_ema"
VALIDATION_DIR = "validation"
LOG_NAME = "log.jsonl"
STATE_FILE = "training_state.json"
MANIFEST_FILE = "manifest.json"
STATUS_FILE = "run_status.json"
# The prefix of every staging folder: what a killed writer leaves, and the next run removes.
STAGING_PREFIX = ".incomplete-"
