"""Regenerate the simulated model's tokenizer files, deterministically.

`python -m kvroute.sim.model.build [--check]` trains a byte-level BPE tokenizer (Hugging Face
`tokenizers`) on a synthetic corpus generated here from a fixed seed, and writes
`tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` into
this directory, next to `chat_template.jinja` (the template is also embedded in
`tokenizer_config.json`, as Hugging Face model directories do). No downloads.

`--check` rebuilds in memory and fails if the committed files differ, so the files in git are
always exactly what this script produces.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

MODEL_DIR = Path(__file__).resolve().parent
VOCAB_SIZE = 4096
SEED = 20240611
NUM_SENTENCES = 40_000

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]


def _words(text: str) -> list[str]:
    return text.split()


_SUBJECTS = _words(
    "the router the engine a worker the scheduler our cluster the cache this model the user "
    "a request the batch the team my assistant the gateway each replica the operator the "
    "server the client the queue the kernel the tokenizer the prompt the system the agent"
)
_VERBS = _words(
    "sends reads writes caches evicts routes schedules returns computes stores loads "
    "measures reports prefers rejects accepts waits streams answers explains summarizes "
    "translates generates checks tracks balances decodes encodes hashes splits merges"
)
_OBJECTS = _words(
    "tokens blocks prefixes messages events batches requests replies vectors tables "
    "prompts answers files records metrics errors graphs logs states windows layers "
    "weights adapters sessions documents questions recipes tickets invoices reports"
)
_ADJECTIVES = _words(
    "fast slow warm cold hot large small hybrid dense sparse shared private stale fresh "
    "long short exact rough simple complex quiet busy idle healthy broken random stable "
    "blue green red yellow ancient modern curious careful"
)
_ADVERBS = _words("quickly slowly carefully rarely often always never eventually again")
_TOPICS = _words(
    "Paris Tokyo Berlin Lisbon Nairobi Lima Oslo Cairo Seoul Toronto python rust golang "
    "kubernetes vLLM GPU H100 attention transformer mamba tomato basil garlic pasta coffee "
    "tea bicycle mountain river ocean history music chess football weather"
)
_QUESTIONS = (
    "What is",
    "How do I",
    "Can you explain",
    "Why does",
    "Where is",
    "When should",
    "Please summarize",
    "Write a short poem about",
    "Translate into French:",
    "Compare",
)
_CODE_LINES = (
    "def main(argv: list[str]) -> int:",
    "    return 0",
    "for i in range(10):",
    "    print(i, i * i)",
    'if __name__ == "__main__":',
    "import json, sys",
    'fn main() { println!("hello"); }',
    "let x: Vec<u32> = vec![1, 2, 3];",
    "SELECT id, name FROM users WHERE age > 30;",
    "kubectl get pods -n default",
    "curl -s http://127.0.0.1:8000/v1/models",
    "x = {'a': 1, 'b': [2, 3]}",
)


def _sentence(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.45:
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS)]
        if rng.random() < 0.5:
            words.append(rng.choice(_ADJECTIVES))
        words.append(rng.choice(_OBJECTS))
        if rng.random() < 0.3:
            words += ["about", rng.choice(_TOPICS)]
        if rng.random() < 0.3:
            words.append(rng.choice(_ADVERBS))
        text = " ".join(words)
        return text[0].upper() + text[1:] + rng.choice(".!.;.")
    if kind < 0.65:
        return f"{rng.choice(_QUESTIONS)} {rng.choice(_ADJECTIVES)} {rng.choice(_TOPICS)}?"
    if kind < 0.78:
        return "\n".join(rng.choice(_CODE_LINES) for _ in range(rng.randint(1, 4)))
    if kind < 0.88:
        args = {rng.choice(_OBJECTS): rng.randint(0, 999), "city": rng.choice(_TOPICS)}
        call = {"name": f"get_{rng.choice(_OBJECTS)}", "arguments": args}
        return f"<tool_call>{json.dumps(call)}</tool_call>"
    if kind < 0.94:
        return " ".join(str(rng.randint(0, 10_000)) for _ in range(rng.randint(2, 8)))
    topic, value, adjective = rng.choice(_TOPICS), rng.random(), rng.choice(_ADJECTIVES)
    return f"{topic}: {value:.4f}, {adjective} ({rng.randint(1, 99)}%)"


def corpus(seed: int = SEED, n: int = NUM_SENTENCES) -> Iterator[str]:
    """The synthetic training text, identical for a given seed."""
    rng = random.Random(seed)
    for _ in range(n):
        yield " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))


def build_tokenizer() -> Tokenizer:
    """Train the byte-level BPE tokenizer (deterministic for the fixed corpus)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama 3: add_special_tokens=True prepends BOS; chat templates emit it themselves.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    return tok


def _config_files(tok: Tokenizer) -> dict[str, str]:
    template = (MODEL_DIR / "chat_template.jinja").read_text(encoding="utf-8")
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
    }
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }

    def dump(obj: object) -> str:
        return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"

    return {
        "tokenizer.json": tok.to_str(pretty=True) + "\n",
        "tokenizer_config.json": dump(tokenizer_config),
        "special_tokens_map.json": dump(special_map),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if files are stale")
    args = parser.parse_args(argv)
    files = _config_files(build_tokenizer())
    stale = [
        name
        for name, text in files.items()
        if not (MODEL_DIR / name).exists() or (MODEL_DIR / name).read_text(encoding="utf-8") != text
    ]
    if args.check:
        if stale:
            print(f"stale tokenizer files: {', '.join(stale)}", file=sys.stderr)
            return 1
        print("tokenizer files are up to date")
        return 0
    for name, text in files.items():
        (MODEL_DIR / name).write_text(text, encoding="utf-8")
    print(f"wrote {', '.join(files)} to {MODEL_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
