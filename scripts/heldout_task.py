"""Write the embedded model's held-out documents as a perplexity task for scripts/eval_tasks.py.

The split is train_tiny.py's own (same corpus, seed and fraction), so the documents were never
trained on. Documents longer than --max_tokens tokens are cut into pieces at line breaks.

    python scripts/heldout_task.py --out=/tmp/heldout.jsonl
    python scripts/eval_tasks.py --tasks=/tmp/heldout.jsonl --model=models/default
"""

import json
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_tiny  # noqa: E402  (a sibling script: the corpus and the split live there)

from models.tokenizers.load import load_tokenizer

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "heldout.jsonl", "where to write the task file")
flags.DEFINE_string("tokenizer_dir", "models/default", "the embedded model's directory")
flags.DEFINE_integer("max_tokens", 480, "longest piece, in tokens (must fit max_model_len - 1)")


def pieces(text: str, tokenizer, max_tokens: int):
    """Cut at line breaks so every piece encodes to at most max_tokens tokens."""
    piece = ""
    for line in text.splitlines(keepends=True):
        if piece and len(tokenizer.encode(piece + line)) > max_tokens:
            yield piece
            piece = ""
        piece += line
    if piece.strip() and len(tokenizer.encode(piece)) <= max_tokens:
        yield piece


def main(argv):
    del argv
    opts = train_tiny.TrainOptions()
    _, held_out = train_tiny.split_documents(train_tiny.corpus_documents(opts.max_source_files),
                                             opts.holdout_fraction, opts.max_docs, opts.seed)
    tokenizer = load_tokenizer(FLAGS.tokenizer_dir)
    count = 0
    with open(FLAGS.out, "w") as f:
        for doc in held_out:
            for text in pieces(doc, tokenizer, FLAGS.max_tokens):
                f.write(json.dumps({"type": "perplexity", "text": text}) + "\n")
                count += 1
    print(f"{count} pieces of {len(held_out)} held-out documents -> {FLAGS.out}")


if __name__ == "__main__":
    app.run(main)
