"""The example datasets shipped in `data/`, generated from templates with a seeded RNG:

- ``data/math-word/{train,test}.jsonl``: word problems in GSM8K's format, ``{"question",
  "answer"}``, the answer a short worked solution ending in ``#### <number>``;
- ``data/code-small/{train,test}.jsonl``: small Python functions in HumanEval's format,
  ``{"prompt", "entry_point", "tests", "canonical_solution"}``: a signature and docstring,
  assert snippets, and the body that passes them;
- ``data/tokenizer/``: a byte-level BPE (digits split one per token) trained on both sets and
  saved as a Hugging Face tokenizer directory with a ChatML chat template.

The numbers are small on purpose: the tiny CPU model learns part of the math set within
minutes, so RL has room to climb. Regenerate (byte-identical output):

    .venv/bin/python -m trace_common.data.examples --out data
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
from collections.abc import Callable, Iterable

MATH_TRAIN_ROWS = 4000
MATH_TEST_ROWS = 300
CODE_TRAIN_ROWS = 300
CODE_TEST_ROWS = 60
TOKENIZER_VOCAB = 640
SEED = 20261205

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the end of an assistant turn: the EOS of completions
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

NAMES = ("Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gia", "Hugo", "Ivy", "Jack", "Kim",
         "Leo", "Mia", "Noah", "Olga", "Paul")  # fmt: skip
THINGS = ("apples", "pears", "books", "coins", "stamps", "shells", "marbles", "pencils",
          "stickers", "cookies", "cards", "plums")  # fmt: skip
ITEMS = ("pen", "cup", "ball", "kite", "hat", "toy")


def _pron(name: str) -> str:
    return "She" if name in ("Ann", "Cara", "Eva", "Gia", "Ivy", "Kim", "Mia", "Olga") else "He"


def _add(rng: random.Random) -> tuple[str, str, int]:
    n, t, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(1, 9), rng.randint(1, 9)
    q = rng.choice((
        f"{n} has {a} {t}. {_pron(n)} gets {b} more. How many {t} does {n} have now?",
        f"{n} had {a} {t} and found {b} more. How many {t} does {n} have?",
        f"There are {a} {t} in a box and {b} {t} on the table. How many {t} are there in all?",
    ))  # fmt: skip
    return q, f"{a} + {b} = {a + b}.", a + b


def _sub(rng: random.Random) -> tuple[str, str, int]:
    n, m, t = rng.choice(NAMES), rng.choice(NAMES), rng.choice(THINGS)
    a = rng.randint(2, 18)
    b = rng.randint(1, min(a, 9))
    q = rng.choice((
        f"{n} has {a} {t} and gives {b} to {m}. How many {t} does {n} have left?",
        f"{n} had {a} {t}. {_pron(n)} lost {b} of them. How many {t} are left?",
    ))  # fmt: skip
    return q, f"{a} - {b} = {a - b}.", a - b


def _mul(rng: random.Random) -> tuple[str, str, int]:
    n, t, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(2, 5), rng.randint(2, 5)
    q = rng.choice((
        f"{n} has {a} bags with {b} {t} in each bag. How many {t} does {n} have?",
        f"{n} buys {a} boxes of {t}. Each box holds {b}. How many {t} does {n} buy?",
    ))  # fmt: skip
    return q, f"{a} * {b} = {a * b}.", a * b


def _div(rng: random.Random) -> tuple[str, str, int]:
    n, t, k, each = rng.choice(NAMES), rng.choice(THINGS), rng.randint(2, 5), rng.randint(1, 5)
    total = k * each
    q = (f"{n} shares {total} {t} equally among {k} friends. How many {t} does each friend "
         "get?")  # fmt: skip
    return q, f"{total} / {k} = {each}.", each


def _two_step(rng: random.Random) -> tuple[str, str, int]:
    n, t, a, b = rng.choice(NAMES), rng.choice(THINGS), rng.randint(1, 9), rng.randint(1, 9)
    c = rng.randint(1, a + b)
    q = (f"{n} has {a} {t}, buys {b} more and then gives away {c}. How many {t} does {n} "
         "have now?")  # fmt: skip
    return q, f"{a} + {b} = {a + b}. {a + b} - {c} = {a + b - c}.", a + b - c


def _price(rng: random.Random) -> tuple[str, str, int]:
    n, item, p, k = rng.choice(NAMES), rng.choice(ITEMS), rng.randint(1, 5), rng.randint(2, 4)
    q = f"A {item} costs {p} dollars. {n} buys {k} of them. How many dollars does {n} pay?"
    return q, f"{k} * {p} = {k * p}.", k * p


MATH_FAMILIES: tuple[Callable[[random.Random], tuple[str, str, int]], ...] = (
    _add,
    _add,
    _sub,
    _sub,
    _mul,
    _div,
    _two_step,
    _price,
)  # addition and subtraction twice as often: the easiest steps for a tiny model


def math_rows(n: int, rng: random.Random, exclude: set[str] | None = None) -> list[dict]:
    """`n` distinct word problems (none of whose questions is in `exclude`)."""
    seen = set(exclude or ())
    rows: list[dict] = []
    while len(rows) < n:
        q, work, result = rng.choice(MATH_FAMILIES)(rng)
        if q in seen:
            continue
        seen.add(q)
        rows.append({"question": q, "answer": f"{work}\n#### {result}"})
    return rows


def _fn(name: str, args: str, doc: str, body: str, tests: list[str]) -> dict:
    return {
        "prompt": f'def {name}({args}):\n    """{doc}"""\n',
        "entry_point": name,
        "tests": tests,
        "canonical_solution": body,
    }


def _code_add(rng: random.Random) -> dict:
    k = rng.randint(1, 20)
    name = rng.choice(("add", "plus", "increase", "shift")) + f"_{k}"
    xs = rng.sample(range(-20, 40), 4)
    return _fn(name, "x", f"Return x plus {k}.", f"    return x + {k}\n",
               [f"assert {name}({x}) == {x + k}" for x in xs])  # fmt: skip


def _code_mul(rng: random.Random) -> dict:
    k = rng.randint(2, 9)
    name = rng.choice(("times", "scale", "multiply")) + f"_{k}"
    xs = rng.sample(range(-10, 20), 4)
    return _fn(name, "x", f"Return x multiplied by {k}.", f"    return x * {k}\n",
               [f"assert {name}({x}) == {x * k}" for x in xs])  # fmt: skip


def _code_max(rng: random.Random) -> dict:
    name = rng.choice(("largest", "biggest", "max_of", "top"))
    cases = [rng.sample(range(-30, 30), rng.randint(1, 5)) for _ in range(4)]
    return _fn(name, "xs", "Return the largest number of the non-empty list xs.",
               "    return max(xs)\n", [f"assert {name}({c}) == {max(c)}" for c in cases])  # fmt: skip


def _code_count(rng: random.Random) -> dict:
    ch = rng.choice("abcdexyz")
    name = f"count_{ch}"
    words = ["".join(rng.choice("abcdexyz") for _ in range(rng.randint(0, 8))) for _ in range(4)]
    return _fn(name, "s", f"Return how many times the letter {ch!r} occurs in s.",
               f"    return s.count({ch!r})\n",
               [f"assert {name}({w!r}) == {w.count(ch)}" for w in words])  # fmt: skip


def _code_reverse(rng: random.Random) -> dict:
    name = rng.choice(("reverse", "backwards", "flip", "mirror"))
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7))) for _ in range(4)]
    return _fn(name, "s", "Return the string s reversed.", "    return s[::-1]\n",
               [f"assert {name}({w!r}) == {w[::-1]!r}" for w in words])  # fmt: skip


def _code_even(rng: random.Random) -> dict:
    name = rng.choice(("is_even", "even", "check_even"))
    xs = rng.sample(range(-20, 40), 4)
    return _fn(name, "n", "Return True when the integer n is even, else False.",
               "    return n % 2 == 0\n", [f"assert {name}({x}) is {x % 2 == 0}" for x in xs])  # fmt: skip


def _code_clamp(rng: random.Random) -> dict:
    lo = rng.randint(-5, 5)
    hi = lo + rng.randint(1, 10)
    name = f"clamp_{lo}_{hi}".replace("-", "m")
    xs = [lo - 3, lo, (lo + hi) // 2, hi + 4]
    return _fn(name, "x", f"Return x limited to the range [{lo}, {hi}].",
               f"    return min(max(x, {lo}), {hi})\n",
               [f"assert {name}({x}) == {min(max(x, lo), hi)}" for x in xs])  # fmt: skip


def _code_squares(rng: random.Random) -> dict:
    name = rng.choice(("sum_squares", "square_sum", "sum_of_squares"))
    cases = [rng.sample(range(-6, 7), rng.randint(0, 4)) for _ in range(4)]
    return _fn(name, "xs", "Return the sum of the squares of the numbers in xs.",
               "    return sum(x * x for x in xs)\n",
               [f"assert {name}({c}) == {sum(x * x for x in c)}" for c in cases])  # fmt: skip


CODE_FAMILIES = (_code_add, _code_mul, _code_max, _code_count, _code_reverse, _code_even,
                 _code_clamp, _code_squares)  # fmt: skip


def code_rows(n: int, rng: random.Random) -> list[dict]:
    return [rng.choice(CODE_FAMILIES)(rng) for _ in range(n)]


def write_jsonl(path: pathlib.Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, sort_keys=True) + "\n")


def tokenizer_texts(math: list[dict], code: list[dict]) -> list[str]:
    return [r["question"] + "\n" + r["answer"] for r in math] + [
        r["prompt"] + r["canonical_solution"] + "\n".join(r["tests"]) for r in code
    ]


def save_tokenizer(path: pathlib.Path, texts: list[str]) -> None:
    """A byte-level BPE of `TOKENIZER_VOCAB` tokens (digits one per token, so numbers are
    spelled digit by digit), saved with transformers as a tokenizer directory with a ChatML
    chat template; no BOS, `<|im_end|>` is EOS, `<|endoftext|>` pads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB, special_tokens=[PAD_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
    )  # fmt: skip
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))


def generate(out: pathlib.Path) -> dict[str, int]:
    """Write every example set under `out`; returns the rows per file."""
    rng = random.Random(SEED)
    math_test = math_rows(MATH_TEST_ROWS, rng)
    math_train = math_rows(MATH_TRAIN_ROWS, rng, exclude={r["question"] for r in math_test})
    code_train = code_rows(CODE_TRAIN_ROWS, rng)
    code_test = code_rows(CODE_TEST_ROWS, rng)
    files = {
        "math-word/train.jsonl": math_train, "math-word/test.jsonl": math_test,
        "code-small/train.jsonl": code_train, "code-small/test.jsonl": code_test,
    }  # fmt: skip
    for name, rows in files.items():
        write_jsonl(out / name, rows)
    save_tokenizer(out / "tokenizer", tokenizer_texts(math_train, code_train))
    return {name: len(rows) for name, rows in files.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("data"))
    args = parser.parse_args()
    for name, n in generate(args.out).items():
        print(f"{args.out / name}: {n} rows")
    print(f"{args.out / 'tokenizer'}: BPE, {TOKENIZER_VOCAB} tokens, ChatML template")


if __name__ == "__main__":
    main()
