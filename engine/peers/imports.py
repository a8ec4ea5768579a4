"""A vLLM or SGLang command line, or a TensorRT-LLM `--extra_llm_api_options` YAML, as dcpctl plan settings: the
inverse of `engine.peers.*_export`, reporting every flag it did not understand. Flag names come from the same
tables the exports use (`VLLM_FLAGS`, `SGLANG_FLAGS`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from engine.errors import UserError
from engine.peers.export import ENGINE_NAMES, model_path_of
from engine.peers.sglang_export import SGLANG_FLAGS
from engine.plan.schema import VLLM_FLAGS, Plan, SpeculativeSection

INT_FIELDS = {
    "model.max_model_len",
    "parallel.tp",
    "parallel.dcp",
    "parallel.interleave",
    "parallel.pp",
    "cache.block_size",
    "scheduler.max_num_seqs",
    "scheduler.max_num_batched_tokens",
    "serve.port",
    "launch.nnodes",
    "launch.node_rank",
    "launch.master_port",
}
DTYPE_NAMES = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_GIB = 2**30


@dataclass
class Imported:
    """Plan settings read from another engine's configuration."""

    engine: str  # vllm | sglang | trtllm
    settings: dict[str, Any] = field(default_factory=dict)  # plan key -> value
    not_understood: list[str] = field(default_factory=list)  # flags (with their values) or keys left out
    notes: list[str] = field(default_factory=list)  # understood, but with no plan field or only approximately

    def plan_data(self, name: str) -> dict[str, Any]:
        """The plan as nested data: its name and description, then the settings by section in the schema's order."""
        data: dict[str, Any] = {"name": name, "description": f"imported from {ENGINE_NAMES[self.engine]}"}
        for section in (f.name for f in fields(Plan)):
            for key, value in self.settings.items():
                if key.startswith(f"{section}."):
                    data.setdefault(section, {})[key.split(".", 1)[1]] = value
        return data


def memory_text(size: int) -> str:
    """Bytes as cache.memory writes them: whole GiB or MiB where they are whole, else bytes."""
    for unit, scale in (("GiB", _GIB), ("MiB", 2**20)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def _typed(key: str, value: str) -> Any:
    if key in INT_FIELDS:
        try:
            return int(value)
        except ValueError:
            raise UserError(f"{key} takes a whole number, not {value!r}") from None
    if key in ("model.dtype", "cache.dtype"):
        return DTYPE_NAMES.get(value, value)
    return value


def _split_words(words: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading ENV=VALUE words, then the command."""
    env = {}
    while words and _ENV_WORD.match(words[0]):
        key, value = words[0].split("=", 1)
        env[key] = value
        words = words[1:]
    return env, words


def _flags(words: list[str], switches: set[str]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs; a positional word is ('', word). Underscores in flag names read as dashes, as vLLM's and
    SGLang's parsers do; `--flag=value` is split. `switches` take no value."""
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(words):
        word = words[i]
        if not word.startswith("-") or re.fullmatch(r"-\d+", word):
            pairs.append(("", word))
            i += 1
            continue
        name, eq, value = word.partition("=")
        name = "--" + name.lstrip("-").replace("_", "-") if name.startswith("--") else name
        if eq:
            pairs.append((name, value))
        elif name in switches or i + 1 >= len(words) or words[i + 1].startswith("--"):
            pairs.append((name, None))
        else:
            pairs.append((name, words[i + 1]))
            i += 1
        i += 1
    return pairs


def _vllm_table() -> dict[str, str]:
    table = {flag.split()[0]: key for key, flag in VLLM_FLAGS.items() if not key.startswith("speculative_config.")}
    table.pop("--gpu-memory-utilization", None)  # cache.memory: handled below, with the bytes flag
    table.update({"-tp": "parallel.tp", "-dcp": "parallel.dcp", "-pp": "parallel.pp"})
    table["--dcp-kv-cache-interleave-size"] = "parallel.interleave"  # vLLM's deprecated name
    table.update({"--nnodes": "launch.nnodes", "--node-rank": "launch.node_rank"})
    table.update({"--master-addr": "launch.master_addr", "--master-port": "launch.master_port"})
    return table


VLLM_SWITCHES = {
    "--enforce-eager",
    "--calculate-kv-scales",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
}


def _speculative(out: Imported, text: str, flag: str) -> None:
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        out.not_understood.append(f"{flag} {text} (not JSON)")
        return
    known = {f for f in SpeculativeSection.__dataclass_fields__}
    for key, value in config.items():
        if key in known:
            out.settings[f"speculative_config.{key}"] = value
        else:
            out.not_understood.append(f"{flag} key {key}={value}")


def _kv_transfer(out: Imported, text: str) -> None:
    try:
        config = json.loads(text)
    except json.JSONDecodeError:
        out.not_understood.append(f"--kv-transfer-config {text} (not JSON)")
        return
    for key, value in config.items():
        if key == "kv_connector" and value == "NixlConnector":
            out.settings["disagg.connector"] = "nixl"
        elif key == "kv_load_failure_policy":
            out.settings["disagg.failure_policy"] = value
        elif key == "kv_role":
            if value == "kv_consumer":
                out.settings["disagg.kv_role"] = value
        else:
            out.not_understood.append(f"--kv-transfer-config key {key}={value}")
    out.notes.append(
        "--kv-transfer-config: this command is one instance of a P/D deployment; a dcpctl P/D plan is the decode "
        "plan with disagg.prefill naming the prefill instance's plan (import that command too)"
    )


def import_vllm(env: dict[str, str], words: list[str]) -> Imported:
    """`vllm serve MODEL ...` (words after `serve`) with its environment, as plan settings."""
    out = Imported("vllm")
    table = _vllm_table()
    for key, value in env.items():
        if key == "VLLM_CPU_KVCACHE_SPACE":
            out.settings["launch.device"] = "cpu"
            out.settings["cache.memory"] = f"{value}GiB"
        elif key == "VLLM_NIXL_SIDE_CHANNEL_PORT":
            out.notes.append(f"{key}={value}: dcpctl's NIXL agents pick their own ports")
        else:
            out.not_understood.append(f"{key}={value}")
    for flag, value in _flags(words, VLLM_SWITCHES):
        if flag == "" and "model.path" not in out.settings:
            out.settings["model.path"] = model_path_of(value)
        elif flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
            out.settings["cache.prefix_caching"] = flag == "--enable-prefix-caching"
        elif flag in ("--enable-chunked-prefill", "--no-enable-chunked-prefill"):
            out.settings["scheduler.chunked_prefill"] = flag == "--enable-chunked-prefill"
        elif flag == "--enforce-eager":
            out.settings["model.enforce_eager"] = True
        elif flag == "--calculate-kv-scales":
            out.settings["cache.calculate_kv_scales"] = True
        elif value is None:
            out.not_understood.append(flag)
        elif flag == "--model":
            out.settings["model.path"] = model_path_of(value)
        elif flag == "--kv-cache-memory-bytes":
            out.settings["cache.memory"] = memory_text(int(value))
        elif flag == "--gpu-memory-utilization":
            out.settings["cache.memory"] = value
            out.notes.append(
                f"--gpu-memory-utilization {value} became cache.memory={value}: dcpctl's fraction is of free memory, "
                "for the KV cache alone"
            )
        elif flag == "--speculative-config":
            _speculative(out, value, flag)
        elif flag == "--kv-transfer-config":
            _kv_transfer(out, value)
        elif flag in table:
            out.settings[table[flag]] = _typed(table[flag], value)
        else:
            out.not_understood.append(f"{flag} {value}" if flag else value)
    return out


SGLANG_SWITCHES = {"--disable-radix-cache", "--trust-remote-code"}


def import_sglang(words: list[str]) -> Imported:
    """`python -m sglang.launch_server ...` (words after the module) as plan settings."""
    out = Imported("sglang")
    table = {flag: key for key, flag in SGLANG_FLAGS.items()}
    for special in ("--mem-fraction-static", "--disable-radix-cache", "--chunked-prefill-size"):
        table.pop(special)
    table.update({"--model": "model.path", "--tp": "parallel.tp"})
    for flag, value in _flags(words, SGLANG_SWITCHES):
        if flag == "--disable-radix-cache":
            out.settings["cache.prefix_caching"] = False
        elif value is None:
            out.not_understood.append(flag)
        elif flag == "--chunked-prefill-size":
            out.settings["scheduler.chunked_prefill"] = int(value) > 0
            if 0 < int(value) != out.settings.get("scheduler.max_num_batched_tokens", int(value)):
                out.notes.append(f"--chunked-prefill-size {value}: dcpctl chunks by scheduler.max_num_batched_tokens")
        elif flag == "--mem-fraction-static":
            out.settings["cache.memory"] = value
            out.notes.append(f"--mem-fraction-static {value} became cache.memory={value} (dcpctl: of free memory)")
        elif flag == "--dist-init-addr":
            host, _, port = value.rpartition(":")
            out.settings["launch.master_addr"], out.settings["launch.master_port"] = host, int(port)
        elif flag.startswith("--disaggregation-"):
            out.notes.append(f"{flag} {value}: one instance of a P/D deployment (dcpctl: disagg.prefill)")
        elif flag in table:
            key = table[flag]
            out.settings[key] = model_path_of(value) if key == "model.path" else _typed(key, value)
        else:
            out.not_understood.append(f"{flag} {value}" if flag else value)
    if out.settings.get("parallel.dcp", 1) > 1:
        out.settings["parallel.interleave"] = 1  # SGLang's DCP interleaves single tokens
    return out


def _trtllm_key(out: Imported, key: str, value: Any) -> None:
    simple = {
        "dtype": "model.dtype",
        "max_seq_len": "model.max_model_len",
        "max_batch_size": "scheduler.max_num_seqs",
        "max_num_tokens": "scheduler.max_num_batched_tokens",
        "enable_chunked_prefill": "scheduler.chunked_prefill",
    }
    if key in simple:
        out.settings[simple[key]] = value
    elif key == "kv_cache_config" and isinstance(value, dict):
        for sub, v in value.items():
            if sub == "tokens_per_block":
                out.settings["cache.block_size"] = v
            elif sub == "enable_block_reuse":
                out.settings["cache.prefix_caching"] = bool(v)
            elif sub == "free_gpu_memory_fraction":
                out.settings["cache.memory"] = str(v)
            elif sub == "dtype" and v == "fp8":
                out.settings["cache.dtype"] = "fp8_e4m3"
            else:
                out.not_understood.append(f"kv_cache_config.{sub}: {v}")
    elif key == "speculative_config" and isinstance(value, dict) and value.get("decoding_type") == "NGram":
        out.settings["speculative_config.method"] = "ngram"
        for sub, v in value.items():
            if sub == "max_draft_len":
                out.settings["speculative_config.num_speculative_tokens"] = v
            elif sub == "max_matching_ngram_size":
                out.settings["speculative_config.prompt_lookup_max"] = v
            elif sub != "decoding_type":
                out.not_understood.append(f"speculative_config.{sub}: {v}")
    elif key == "cache_transceiver_config":
        out.notes.append("cache_transceiver_config: one server of a disaggregated deployment (dcpctl: disagg.prefill)")
    elif key not in ("tensor_parallel_size", "context_parallel_size", "cp_config"):
        out.not_understood.append(f"{key}: {value}")


def import_trtllm(config_file: str | Path, words: list[str]) -> Imported:
    """A TensorRT-LLM `--extra_llm_api_options` YAML (and the `trtllm-serve MODEL ...` words) as plan settings.

    Its world is tensor_parallel_size x context_parallel_size; a Helix layout (context_parallel_size > 1) is read as
    DCP inside the TP group: tp = tensor_parallel_size x context_parallel_size, dcp = context_parallel_size,
    interleave = cp_config.tokens_per_block."""
    try:
        config = yaml.safe_load(Path(config_file).read_text())
    except OSError as exc:
        raise UserError(f"cannot read --trtllm {config_file}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--trtllm {config_file} is not YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise UserError(f"--trtllm {config_file} must hold a mapping of LLM API options")
    out = Imported("trtllm")
    for flag, value in _flags(words, set()):
        if flag == "" and "model.path" not in out.settings:
            out.settings["model.path"] = model_path_of(value)
        elif flag in ("--host", "--port"):
            out.settings[f"serve.{flag[2:]}"] = _typed(f"serve.{flag[2:]}", value or "")
        elif flag not in ("--extra_llm_api_options", "--extra-llm-api-options"):
            out.not_understood.append(f"{flag} {value}" if value else flag)
    tp, cp = int(config.get("tensor_parallel_size", 1)), int(config.get("context_parallel_size", 1))
    out.settings["parallel.tp"] = tp * cp
    if cp > 1:
        cp_config = config.get("cp_config") or {}
        if cp_config.get("cp_type", "HELIX").upper() != "HELIX":
            out.not_understood.append(f"cp_config.cp_type: {cp_config.get('cp_type')} (dcpctl reads HELIX)")
        out.settings["parallel.dcp"] = cp
        out.notes.append(
            f"Helix tensor_parallel_size={tp} x context_parallel_size={cp}: read as parallel.tp={tp * cp} with "
            f"parallel.dcp={cp} inside the TP group (the same {tp * cp} ranks and KV sharding)"
        )
        block = cp_config.get("tokens_per_block", (config.get("kv_cache_config") or {}).get("tokens_per_block"))
        if block is not None:
            out.settings["parallel.interleave"] = block
    for key, value in config.items():
        _trtllm_key(out, key, value)
    return out


def _is_python(word: str) -> bool:
    return re.fullmatch(r"python[\d.]*", Path(word).name) is not None


def import_words(words: list[str], trtllm: str | None = None) -> Imported:
    """The engine's settings from its command line words (`vllm serve ...`, `python -m sglang.launch_server ...`,
    `trtllm-serve MODEL ...` with a `trtllm` YAML)."""
    env, command = _split_words(list(words))
    if trtllm is not None:
        if command[:1] == ["trtllm-serve"]:
            command = command[1:]
        imported = import_trtllm(trtllm, command)
    elif len(command) >= 2 and Path(command[0]).name == "vllm" and command[1] == "serve":
        return import_vllm(env, command[2:])
    elif len(command) >= 3 and _is_python(command[0]) and command[1:3] == ["-m", "sglang.launch_server"]:
        imported = import_sglang(command[3:])
    else:
        shown = " ".join(command[:3]) or "nothing"
        raise UserError(
            f"cannot tell the engine from {shown!r}: give `vllm serve MODEL ...`, `python -m sglang.launch_server "
            "...`, or `--trtllm FILE` (with `trtllm-serve MODEL ...` after --)"
        )
    imported.not_understood[:0] = [f"{k}={v}" for k, v in env.items()]
    return imported
