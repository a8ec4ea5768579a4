"""Tiny random checkpoints (Llama, Qwen2, DeepseekV2) that HF transformers and our engine both load offline.

The weights are not HF's default init: every parameter is drawn from one seeded generator in name order, with
scales chosen so that logits are far from uniform. Greedy decoding then has wide top-1/top-2 margins, so two
correct implementations pick the same tokens despite float rounding, and it does not collapse into repeating
one token.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.errors import UserError

ARCHS = ("llama", "qwen2", "deepseek_v2")

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""ids 0, 1, 2: unk/pad, bos, eos (the SmolLM2 / ChatML convention)."""
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

PROVENANCE_FILE = "dcpctl-tiny.json"
MIN_VOCAB = 320  # 256 byte tokens + specials + a few merges

_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
}
_GQA_DEFAULTS: dict[str, Any] = {"num_kv_heads": 2, "head_dim": 16}
_DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "kv_lora_rank": 32,
    "q_lora_rank": None,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": None,
    "topk_group": None,
    # DeepSeek-V2-Lite's rope_scaling, scaled down: factor 40 over 4096 there.
    "yarn": True,
    "yarn_factor": 4.0,
    "original_max_position_embeddings": None,  # None: max_position_embeddings / yarn_factor
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}

# Init scales (std of each parameter family); see the module docstring for why they are this large.
_EMBED_STD = 1.0
_LINEAR_GAIN = 2.0  # std = gain / sqrt(fan_in)
# o_proj / down_proj gain, relative to the embedding std: the layers' outputs must outweigh the token
# embedding in the residual stream, or (tied embeddings especially) greedy decoding repeats the input token.
_OUT_GAIN_PER_EMBED_STD = 3.0
_ROUTER_GAIN = 3.0  # spread router logits so the top-k experts are rarely a near tie
_LOGIT_STD = 16.0  # lm_head std = this / sqrt(hidden_size): logits spread this much whatever the width
_BIAS_STD = 0.2
_NORM_RANGE = (0.75, 1.25)


def default_sizes(arch: str) -> dict[str, Any]:
    """All size options accepted for `arch`, with their defaults."""
    _check_arch(arch)
    extra = _DEEPSEEK_DEFAULTS if arch == "deepseek_v2" else _GQA_DEFAULTS
    return {**_COMMON_DEFAULTS, **extra}


def make_tiny_checkpoint(
    out: str | os.PathLike, arch: str, seed: int = 0, *, overwrite: bool = False, **sizes: Any
) -> Path:
    """Write a random `arch` checkpoint (config, safetensors, tokenizer) to `out` and return its path.

    Size options are those of `default_sizes(arch)`; the same seed and sizes give byte-identical files. The
    folder appears whole (built alongside, then renamed); an existing non-empty `out` needs `overwrite=True`.
    """
    out = Path(out).expanduser()
    resolved = _resolve_sizes(arch, sizes)
    _check_out(out, overwrite)

    import torch

    config = _build_config(arch, resolved)
    tokenizer = _build_tokenizer(resolved["vocab_size"], resolved["max_position_embeddings"])

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.tmp-") as work:
        build = Path(work) / "build"
        with quiet_hf():
            from transformers import AutoModelForCausalLM

            with _torch_seed(seed):
                model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            init_weights(model, seed)
            model.save_pretrained(build)
            tokenizer.save_pretrained(build)
        provenance = {"arch": arch, "seed": seed, "sizes": resolved}
        (build / PROVENANCE_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
        make_readable(build)
        _move_into_place(build, out, Path(work))
    return out


def init_weights(model: Any, seed: int) -> None:
    """Overwrite every parameter of `model` from one generator seeded with `seed`, in name order."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    hidden = model.config.hidden_size
    embed_std = _LOGIT_STD / math.sqrt(hidden) if tied else _EMBED_STD
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            shape = param.shape
            if "norm" in name:
                lo, hi = _NORM_RANGE
                value = lo + (hi - lo) * torch.rand(shape, generator=gen)
            elif name.endswith(".bias"):
                value = _BIAS_STD * torch.randn(shape, generator=gen)
            elif name.startswith("lm_head"):
                value = _LOGIT_STD / math.sqrt(shape[-1]) * torch.randn(shape, generator=gen)
            elif "embed_tokens" in name:
                value = embed_std * torch.randn(shape, generator=gen)
            else:
                gain = _LINEAR_GAIN
                if name.endswith("mlp.gate.weight"):
                    gain = _ROUTER_GAIN
                elif "o_proj" in name or "down_proj" in name:
                    gain = _OUT_GAIN_PER_EMBED_STD * embed_std
                value = gain / math.sqrt(shape[-1]) * torch.randn(shape, generator=gen)
            param.copy_(value.to(param.dtype))


def make_readable(folder: Path) -> None:
    """Give every file in `folder` mode 0644: some writers use private temp files (0600), and model folders
    are shared (the cache)."""
    for path in folder.iterdir():
        if path.is_file():
            path.chmod(0o644)


@contextlib.contextmanager
def quiet_hf() -> Iterator[None]:
    """Silence transformers' progress bars and info/warning logs for the duration."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise UserError(f"unknown tiny model arch {arch!r}: use one of {', '.join(ARCHS)}")


def _resolve_sizes(arch: str, sizes: dict[str, Any]) -> dict[str, Any]:
    resolved = default_sizes(arch)
    unknown = sorted(set(sizes) - set(resolved))
    if unknown:
        raise UserError(
            f"size option(s) {', '.join(unknown)} do not apply to arch {arch}: use any of {', '.join(sorted(resolved))}"
        )
    resolved.update(sizes)
    r = resolved
    for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size", "max_position_embeddings"):
        if int(r[key]) < 1:
            raise UserError(f"{key} must be >= 1 (got {r[key]})")
    if r["vocab_size"] < MIN_VOCAB:
        raise UserError(f"vocab_size must be >= {MIN_VOCAB} for the byte-level tokenizer (got {r['vocab_size']})")
    if arch == "deepseek_v2":
        if r["q_lora_rank"] == 0:
            r["q_lora_rank"] = None
        if r["hidden_size"] % r["num_heads"]:
            raise UserError(
                f"hidden_size ({r['hidden_size']}) must be a multiple of num_heads ({r['num_heads']}) "
                "for transformers' DeepseekV2Config"
            )
        if r["qk_rope_head_dim"] % 2:
            raise UserError(f"qk_rope_head_dim must be even (got {r['qk_rope_head_dim']})")
        if r["n_routed_experts"] and not 1 <= r["num_experts_per_tok"] <= r["n_routed_experts"]:
            raise UserError(
                f"num_experts_per_tok ({r['num_experts_per_tok']}) must be between 1 and "
                f"n_routed_experts ({r['n_routed_experts']})"
            )
        if r["yarn"] and r["original_max_position_embeddings"] is None:
            r["original_max_position_embeddings"] = max(1, int(r["max_position_embeddings"] / r["yarn_factor"]))
    else:
        if r["num_heads"] % r["num_kv_heads"]:
            raise UserError(f"num_heads ({r['num_heads']}) must be a multiple of num_kv_heads ({r['num_kv_heads']})")
        if r["head_dim"] % 2:
            raise UserError(f"head_dim must be even for rotary embeddings (got {r['head_dim']})")
    return r


def _build_config(arch: str, r: dict[str, Any]) -> Any:
    common = {
        "vocab_size": r["vocab_size"],
        "hidden_size": r["hidden_size"],
        "intermediate_size": r["intermediate_size"],
        "num_hidden_layers": r["num_layers"],
        "num_attention_heads": r["num_heads"],
        "max_position_embeddings": r["max_position_embeddings"],
        "rms_norm_eps": r["rms_norm_eps"],
        "tie_word_embeddings": r["tie_word_embeddings"],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(
            **common,
            num_key_value_heads=r["num_kv_heads"],
            head_dim=r["head_dim"],
            rope_parameters={"rope_type": "default", "rope_theta": r["rope_theta"]},
        )
    if arch == "qwen2":
        from transformers import Qwen2Config

        # Qwen2's q/k/v projections always carry a bias; there is no flag for it.
        return Qwen2Config(
            **common,
            num_key_value_heads=r["num_kv_heads"],
            head_dim=r["head_dim"],
            rope_parameters={"rope_type": "default", "rope_theta": r["rope_theta"]},
        )
    from transformers import DeepseekV2Config

    if r["yarn"]:
        rope = {
            "rope_type": "yarn",
            "rope_theta": r["rope_theta"],
            "factor": float(r["yarn_factor"]),
            "original_max_position_embeddings": int(r["original_max_position_embeddings"]),
            "mscale": float(r["mscale"]),
            "mscale_all_dim": float(r["mscale_all_dim"]),
            "beta_fast": float(r["beta_fast"]),
            "beta_slow": float(r["beta_slow"]),
        }
    else:
        rope = {"rope_type": "default", "rope_theta": r["rope_theta"]}
    n_experts = r["n_routed_experts"]
    return DeepseekV2Config(
        **common,
        kv_lora_rank=r["kv_lora_rank"],
        q_lora_rank=r["q_lora_rank"],
        qk_nope_head_dim=r["qk_nope_head_dim"],
        qk_rope_head_dim=r["qk_rope_head_dim"],
        v_head_dim=r["v_head_dim"],
        # n_routed_experts = 0 means a dense model: HF builds a MoE block from layer first_k_dense_replace on.
        n_routed_experts=n_experts if n_experts else 1,
        first_k_dense_replace=r["first_k_dense_replace"] if n_experts else r["num_layers"],
        num_experts_per_tok=r["num_experts_per_tok"] if n_experts else 1,
        n_shared_experts=r["n_shared_experts"],
        moe_intermediate_size=r["moe_intermediate_size"],
        routed_scaling_factor=float(r["routed_scaling_factor"]),
        topk_method=r["topk_method"],
        n_group=r["n_group"],
        topk_group=r["topk_group"],
        norm_topk_prob=False,
        rope_parameters=rope,
    )


@contextlib.contextmanager
def _torch_seed(seed: int) -> Iterator[None]:
    import torch

    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def _build_tokenizer(vocab_size: int, max_length: int) -> Any:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_train_tokenizer_json(vocab_size)),
        unk_token=SPECIAL_TOKENS[PAD_ID],
        pad_token=SPECIAL_TOKENS[PAD_ID],
        bos_token=SPECIAL_TOKENS[BOS_ID],
        eos_token=SPECIAL_TOKENS[EOS_ID],
        model_max_length=max_length,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


@functools.lru_cache(maxsize=8)
def _train_tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    return tok.to_str()


def corpus_lines() -> list[str]:
    """The built-in tokenizer training text: fixed prose, code and chat, plus seeded arithmetic sentences."""
    lines = [line for line in _CORPUS.strip().splitlines() if line.strip()]
    rng = random.Random(20240611)
    words = _WORD_TEXT.split()
    for _ in range(400):
        name = rng.choice(_NAMES)
        item = rng.choice(_ITEMS)
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        op = rng.choice(["+", "-", "*"])
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        lines.append(f"{name} has {a} {item} and gets {b} more. {a} {op} {b} = {value}. #### {value}")
    for _ in range(600):
        picked = [rng.choice(words) for _ in range(rng.randint(6, 14))]
        lines.append(" ".join(picked).capitalize() + rng.choice([".", ".", "?", "!"]))
    return lines


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} exists and is not a folder: pick another output path")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out} already exists and is not empty: pick another folder or overwrite it (--force)")


def _move_into_place(build: Path, out: Path, work: Path) -> None:
    if out.is_dir():
        if any(out.iterdir()):
            os.replace(out, work / "old")  # removed with the work folder
        else:
            out.rmdir()
    os.replace(build, out)
    shutil.rmtree(work / "old", ignore_errors=True)


_NAMES = ["Ava", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemal", "Lena"]
_ITEMS = ["apples", "books", "coins", "marbles", "pencils", "stamps", "cookies", "shells", "cards", "tickets"]

_WORD_TEXT = """
the a an and or but if then when while because so of to in on at by for with from about into over after
before under between through during without again also only very more most some any each every all both
time year day week hour minute people man woman child friend family house home school city world country
water food bread money book letter paper table window door road river mountain garden market train car
make take give find think know want need use work play read write speak listen learn teach help start
stop open close move carry bring send keep hold turn run walk sit stand wait watch look see hear feel
good new old great little small large long short high low early late young right left first last next
number count sum total half double price cost pay sell buy share split part piece group set list order
question answer problem reason step result check value rule plan model token block cache rank layer head
"""

_CORPUS = """
The quick brown fox jumps over the lazy dog. A small model reads one token at a time and guesses the next.
Once upon a time there was a little robot who liked to count the stars at night.
Every evening it climbed the hill behind the town, sat on a flat rock and wrote numbers in a notebook.
The baker on the corner sold bread, rolls and cakes. On Mondays she baked twice as many loaves as on Sundays.
Rain fell on the river, and the river carried the leaves down to the sea.
Question: Tom has 3 boxes with 12 pencils in each box. How many pencils does he have?
Answer: Each box holds 12 pencils, so 3 boxes hold 3 * 12 = 36 pencils. #### 36
Question: A train leaves at 9:15 and arrives at 11:45. How long is the trip?
Answer: From 9:15 to 11:15 is 2 hours, and 11:15 to 11:45 is 30 minutes, so 2.5 hours. #### 2.5
Question: Mia buys 4 notebooks for $2 each and a pen for $3. How much does she spend?
Answer: The notebooks cost 4 * 2 = 8 dollars. With the pen, 8 + 3 = 11 dollars. #### 11
Question: There are 24 students and each table seats 6. How many tables are needed?
Answer: 24 / 6 = 4 tables. #### 4
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
class Cache:
    def __init__(self, size: int) -> None:
        self.blocks = [None] * size
if __name__ == "__main__":
    main()
{"role": "user", "content": "Hello! Can you help me?"}
{"role": "assistant", "content": "Of course. What do you need?"}
<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
<|im_start|>user
Write a short poem about the sea.<|im_end|>
<|im_start|>assistant
Waves roll in and waves roll out, the gulls above them wheel about.<|im_end|>
Attention lets every position look back at earlier positions and mix their values.
The key and value cache keeps the past so that each new token costs only one step.
When the cache is split across ranks, each rank holds a share of the tokens and the results are merged.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 40 50 64 100 128 256 512 1000 1024.
Days: Monday Tuesday Wednesday Thursday Friday Saturday Sunday. Months: January February March April May June.
Colors: red orange yellow green blue indigo violet black white gray brown pink.
Punctuation and symbols: ( ) [ ] { } < > , . ; : ! ? ' " - _ = + * / % & | ^ ~ # @ $
She said, "Let's go to the market tomorrow morning." He answered, "Only if it doesn't rain."
In 1969 people walked on the moon. In 2001 the new library opened with 25,000 books.
Water boils at 100 degrees Celsius and freezes at 0 degrees Celsius at sea level.
The farmer planted 7 rows of corn with 15 plants in each row, then 3 more rows of beans.
Please summarize the following text in one sentence, then list three key points.
First, read the whole problem. Second, write down what is known. Third, solve step by step.
"""
