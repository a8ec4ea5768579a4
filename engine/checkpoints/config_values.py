"""A checkpoint's transformers config as plain values, so that only one rank imports transformers to read it.

`import transformers` and its config classes cost a rank about 2 s of CPU before it can build anything (transformers
5 pulls in torch.distributed.tensor and sympy for them). Rank 0 reads the config with transformers (`read_config`)
and sends the other ranks a `ConfigValues`: what the engine reads from a config, with nothing to import.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.errors import UserError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigValues:
    """The public attributes of a transformers config (its instance attributes and its `attribute_map` aliases) as
    picklable values, read as attributes; for a rope type other than "default", `rope_init`: the inverse frequencies
    and attention scaling that transformers' init function computed from the config."""

    def __init__(self, values: dict[str, object]):
        self._values = values

    def __getattr__(self, name: str) -> object:
        try:  # __dict__ first: unpickling looks up attributes before _values is set
            return self.__dict__["_values"][name]
        except KeyError:
            raise AttributeError(name) from None


def rope_type(config) -> str:
    """The config's rope type ("default" without rope parameters)."""
    return (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")


def rope_init(config, kind: str) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and attention scaling for rope type `kind` (not "default"): the ones a
    ConfigValues carries, else computed from the transformers config."""
    if isinstance(config, ConfigValues):
        return config.rope_init
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[kind](config, torch.device("cpu"))


def config_values(config) -> ConfigValues:
    """The values of transformers config `config` that the engine reads."""
    values = {name: value for name, value in vars(config).items() if not name.startswith("_")}
    values.update({alias: getattr(config, name) for alias, name in config.attribute_map.items()})
    values.setdefault("model_type", config.model_type)  # a class attribute, in vars() only when config.json names it
    kind = rope_type(config)
    if kind != "default" and kind in SUPPORTED_ROPE_TYPES:
        values["rope_init"] = rope_init(config, kind)
    return ConfigValues(values)


def read_config(folder: str | Path) -> ConfigValues:
    """The checkpoint's config.json as transformers parses it (its defaults filled in), as plain values."""
    from transformers import AutoConfig

    try:  # transformers' own checks raise KeyError, TypeError, huggingface_hub's validation errors, ...
        return config_values(AutoConfig.from_pretrained(folder))
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise UserError(f"{folder}/config.json: transformers cannot read it ({type(exc).__name__}: {reason})") from None
