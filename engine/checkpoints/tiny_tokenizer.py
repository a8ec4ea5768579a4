"""The tiny checkpoints' tokenizer: byte-level BPE trained offline on a small built-in corpus (prose, arithmetic in
GSM8K's answer format, code, chat), with the SmolLM2 / ChatML special tokens and chat template."""

from __future__ import annotations

import functools
import random
from typing import Any

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""ids 0, 1, 2: unk/pad, bos, eos (the SmolLM2 / ChatML convention)."""
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def build_tokenizer(vocab_size: int, max_length: int) -> Any:
    """A byte-level BPE tokenizer of `vocab_size` tokens trained on `corpus_lines`, with a ChatML chat template."""
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
