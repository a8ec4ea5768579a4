"""`dcpctl model ...`: make tiny random checkpoints, fetch real ones."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from engine.checkpoints.tiny import default_sizes

app = typer.Typer(
    help="Make tiny random checkpoints for tests; fetch and convert real ones.",
    no_args_is_help=True,
    add_completion=False,
)

_out = Console(highlight=False, soft_wrap=True)
_err = Console(stderr=True, highlight=False)


class Arch(str, Enum):
    llama = "llama"
    qwen2 = "qwen2"
    deepseek_v2 = "deepseek_v2"


_DEFAULTS = {**default_sizes("llama"), **default_sizes("deepseek_v2")}


def _d(key: str, note: str = "") -> str:
    """Help text with the default taken from engine.checkpoints.tiny."""
    value = _DEFAULTS[key]
    shown = "off (0)" if key == "q_lora_rank" and value is None else value
    if key == "original_max_position_embeddings" and value is None:
        shown = "max_position_embeddings / yarn_factor"
    return f"{note} [default: {shown}]".strip()


_ALL = "Sizes (all archs)"
_GQA = "Sizes (llama, qwen2)"
_MLA = "Sizes (deepseek_v2)"


@app.command()
def tiny(
    out: str = typer.Argument(..., help="Folder to create (must be absent or empty unless --force)."),
    arch: Arch = typer.Option(..., "--arch", help="Model architecture."),
    seed: int = typer.Option(0, help="Weight seed; the same seed and sizes give identical files."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty OUT."),
    hidden_size: int | None = typer.Option(None, help=_d("hidden_size"), rich_help_panel=_ALL),
    num_layers: int | None = typer.Option(None, help=_d("num_layers"), rich_help_panel=_ALL),
    num_heads: int | None = typer.Option(None, help=_d("num_heads"), rich_help_panel=_ALL),
    intermediate_size: int | None = typer.Option(None, help=_d("intermediate_size"), rich_help_panel=_ALL),
    vocab_size: int | None = typer.Option(None, help=_d("vocab_size"), rich_help_panel=_ALL),
    max_position_embeddings: int | None = typer.Option(None, help=_d("max_position_embeddings"), rich_help_panel=_ALL),
    tie_word_embeddings: bool | None = typer.Option(None, help=_d("tie_word_embeddings"), rich_help_panel=_ALL),
    rope_theta: float | None = typer.Option(None, help=_d("rope_theta"), rich_help_panel=_ALL),
    num_kv_heads: int | None = typer.Option(None, help=_d("num_kv_heads"), rich_help_panel=_GQA),
    head_dim: int | None = typer.Option(None, help=_d("head_dim"), rich_help_panel=_GQA),
    kv_lora_rank: int | None = typer.Option(None, help=_d("kv_lora_rank"), rich_help_panel=_MLA),
    q_lora_rank: int | None = typer.Option(
        None, help=_d("q_lora_rank", "0: no q LoRA (q_proj)."), rich_help_panel=_MLA
    ),
    qk_nope_head_dim: int | None = typer.Option(None, help=_d("qk_nope_head_dim"), rich_help_panel=_MLA),
    qk_rope_head_dim: int | None = typer.Option(None, help=_d("qk_rope_head_dim"), rich_help_panel=_MLA),
    v_head_dim: int | None = typer.Option(None, help=_d("v_head_dim"), rich_help_panel=_MLA),
    n_routed_experts: int | None = typer.Option(
        None, help=_d("n_routed_experts", "0: dense MLP in every layer."), rich_help_panel=_MLA
    ),
    num_experts_per_tok: int | None = typer.Option(None, help=_d("num_experts_per_tok"), rich_help_panel=_MLA),
    n_shared_experts: int | None = typer.Option(None, help=_d("n_shared_experts"), rich_help_panel=_MLA),
    moe_intermediate_size: int | None = typer.Option(None, help=_d("moe_intermediate_size"), rich_help_panel=_MLA),
    first_k_dense_replace: int | None = typer.Option(None, help=_d("first_k_dense_replace"), rich_help_panel=_MLA),
    routed_scaling_factor: float | None = typer.Option(None, help=_d("routed_scaling_factor"), rich_help_panel=_MLA),
    yarn: bool | None = typer.Option(None, help=_d("yarn", "YaRN rope scaling."), rich_help_panel=_MLA),
    yarn_factor: float | None = typer.Option(None, help=_d("yarn_factor"), rich_help_panel=_MLA),
    original_max_position_embeddings: int | None = typer.Option(
        None, help=_d("original_max_position_embeddings"), rich_help_panel=_MLA
    ),
    mscale: float | None = typer.Option(None, help=_d("mscale"), rich_help_panel=_MLA),
    mscale_all_dim: float | None = typer.Option(None, help=_d("mscale_all_dim"), rich_help_panel=_MLA),
) -> None:
    """Create a tiny random checkpoint that HF transformers and dcpctl both load."""
    from engine.checkpoints.tiny import make_tiny_checkpoint

    options: dict[str, Any] = {
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_theta": rope_theta,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "kv_lora_rank": kv_lora_rank,
        "q_lora_rank": q_lora_rank,
        "qk_nope_head_dim": qk_nope_head_dim,
        "qk_rope_head_dim": qk_rope_head_dim,
        "v_head_dim": v_head_dim,
        "n_routed_experts": n_routed_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "n_shared_experts": n_shared_experts,
        "moe_intermediate_size": moe_intermediate_size,
        "first_k_dense_replace": first_k_dense_replace,
        "routed_scaling_factor": routed_scaling_factor,
        "yarn": yarn,
        "yarn_factor": yarn_factor,
        "original_max_position_embeddings": original_max_position_embeddings,
        "mscale": mscale,
        "mscale_all_dim": mscale_all_dim,
    }
    sizes = {k: v for k, v in options.items() if v is not None}
    path = make_tiny_checkpoint(out, arch.value, seed, overwrite=force, **sizes)
    _out.print(str(path))


@app.command()
def random(
    name: str = typer.Argument(
        ..., help="A named model: deepseek-v2-lite, llama-3.1-8b-instruct, ... (see the error)."
    ),
    output: str = typer.Option(
        ..., "--output", "-o", help="Folder to create (must be absent or empty unless --force)."
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="KEY=VALUE: change one config.json field (e.g. num_hidden_layers=2 for a quick check)."
    ),
    dtype: str = typer.Option("bfloat16", help="Weight dtype: bfloat16, float16 or float32."),
    device: str = typer.Option("auto", help="Where the weights are drawn: auto (CUDA when present), cuda or cpu."),
    seed: int = typer.Option(0, help="Weight seed."),
    shard_mib: int = typer.Option(2048, help="Largest safetensors shard in MiB (a bigger tensor gets its own)."),
    force: bool = typer.Option(False, "--force", help="Replace a non-empty output folder."),
) -> None:
    """Write a model folder with a named model's real config and random weights (for real-size speed checks)."""
    from engine.checkpoints.random_model import make_random_checkpoint, parse_overrides

    path = make_random_checkpoint(
        name,
        output,
        overrides=parse_overrides(set_),
        dtype=dtype,
        device=device,
        seed=seed,
        max_shard_bytes=shard_mib << 20,
        overwrite=force,
    )
    _out.print(str(path))


@app.command()
def pull(
    name: str = typer.Argument(..., help="A known alias (e.g. smollm2-135m-instruct) or a hub id ORG/NAME."),
    dest: Path | None = typer.Option(None, "--dest", help="Target folder (default: the dcpctl model cache)."),
) -> None:
    """Fetch a real checkpoint into a plain HF folder (float32 safetensors + tokenizer)."""
    from engine.checkpoints.pull import pull_model

    path = pull_model(name, dest, console=_err)
    _out.print(str(path))
