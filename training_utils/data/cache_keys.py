"""What determines a frozen encoder's outputs, as short stable strings that key a `feature_store.FeatureStore`:
`describe` turns an encoder (its class, configuration and a sample of its weights), a tokenizer (its vocabulary and
settings), a function (its code) or a setting into one; `digest` shortens any text.
"""

import hashlib
import json
import weakref

import torch

# How much of each weight tensor identifies a module: its first and last elements (a fine-tune changes them
# all), read from a few pages rather than from the whole memory-mapped file.
FINGERPRINT_ELEMENTS = 4096
# Modules sharded with FSDP2 (`text_encoder_sharding`), described as they were whole: their parts differ by process.
_described_whole = weakref.WeakKeyDictionary()


def digest(text):
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def tensor_sample(tensor):
    """The bytes that identify a tensor: its dtype, shape and first and last elements. A quantised tensor
    (a torch tensor subclass) is identified by its inner tensors."""
    if hasattr(type(tensor), "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return b"".join(tensor_sample(getattr(tensor, name)) for name in names)
    flat = tensor.detach().reshape(-1)
    ends = torch.cat([flat[:FINGERPRINT_ELEMENTS], flat[-FINGERPRINT_ELEMENTS:]]).contiguous().cpu()
    return f"{tensor.dtype}{tuple(tensor.shape)}".encode() + ends.view(torch.uint8).numpy().tobytes()


def module_config(module):
    """The module's configuration as a dict, without what does not change its outputs (where it was loaded from,
    the library's version)."""
    config = getattr(module, "config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    return {key: value for key, value in config.items()
            if not key.startswith("_") and key not in ("transformers_version", "name_or_path")}


def code_text(code):
    """A function's code, nested functions included: a script's encoding function, edited, is another one."""
    consts = [code_text(const) if hasattr(const, "co_code") else repr(const) for const in code.co_consts]
    return f"{code.co_code.hex()}|{code.co_names}|{consts}"


def describe(thing):
    """A short string that changes whenever what ``thing`` computes could change: for a module its class,
    configuration and weights; for a tokenizer its vocabulary and settings; for a function its code; for
    anything else its JSON."""
    name = type(thing).__name__
    if isinstance(thing, torch.nn.Module) and thing in _described_whole:
        return _described_whole[thing]
    if isinstance(thing, torch.nn.Module):
        hasher = hashlib.blake2b(digest_size=16)
        hasher.update(json.dumps(module_config(thing), sort_keys=True, default=str).encode())
        for key, tensor in thing.state_dict().items():
            hasher.update(key.encode())
            hasher.update(tensor_sample(tensor))
        return f"{name} {hasher.hexdigest()}"
    if hasattr(thing, "get_vocab"):
        backend = getattr(thing, "backend_tokenizer", None)
        if backend is not None:
            tokenizer = json.loads(backend.to_str())
            for per_call in ("truncation", "padding"):  # what each call sets, from its arguments
                tokenizer.pop(per_call, None)
            vocabulary = json.dumps(tokenizer, sort_keys=True)
        else:
            vocabulary = json.dumps(sorted(thing.get_vocab().items()))
        return f"{name} {digest(vocabulary + repr((thing.model_max_length, thing.padding_side)))}"
    if callable(thing) and hasattr(thing, "__code__"):
        return f"code {digest(code_text(thing.__code__))}"
    return json.dumps(thing, sort_keys=True, default=str)


def describe_before_sharding(module):
    """Have `describe` give for ``module``, about to be sharded, what it gives now, whole: a sharded module keys the
    same caches as the whole one (the same outputs), on every process."""
    _described_whole[module] = describe(module)
