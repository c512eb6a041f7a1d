"""Train a tiny Llama-architecture model and its sentencepiece tokenizer on text every CPython ships.

The corpus is the language reference topics (`pydoc_data/topics.py`) plus the docstrings of the standard
library's modules, classes and functions, read with `ast` (no module is imported but the topics' plain dict),
each framed as the `def`/`class`/`import` line it documents. Each document becomes
BOS ... EOS; a fixed share of documents is held out for a per-token perplexity.

The model is Ferry's own `Transformer`; training runs a plain causal forward over [batch, seq] built from
the model's submodules (no KV cache), so the trained parameters are exactly the served ones. The result is
a Ferry checkpoint (model.safetensors + ferry_config.json) with tokenizer.model, tokenizer_config.json,
generation_config.json and train_report.json in --out_dir. Sample generations at the end go through the
paged inference path on the checkpoint as loaded from disk.

    python scripts/train_tiny.py                       # the default model: ~20 minutes on 2 idle CPU cores
    python scripts/train_tiny.py --steps=20 --vocab=400 --layers=1 --hidden=64 --seq_len=64 --max_docs=200

Deterministic given --seed and the Python build (its stdlib is the corpus): sorted file lists, seeded
shuffles, XLA's deterministic CPU kernels; only a --minutes cut-off depends on the clock.
"""

import ast
import dataclasses
import io
import json
import math
import os
import sys
import sysconfig
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags, logging
from flax import nnx
from tqdm import tqdm

from engine.worker.packing import SeqSlice, StepLayout, bucket, pack
from engine.worker.step import model_step
from models.checkpoints.ferry import save_checkpoint
from models.config import ModelConfig
from models.loading import LoadedModel, load_model, random_model
from models.paged import init_kv_cache
from models.tokenizers.load import load_tokenizer
from models.transformer import ForwardContext, apply_rope, rope_cos_sin
from pallas_kernels.kernels import Kernels

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# Test directories hold fixtures and deliberately broken code, not documentation.
SKIPPED_DIRS = frozenset({"test", "tests", "idle_test", "__pycache__", "site-packages"})
# No trailing space: sentencepiece would make it a lone "▁" piece, which training text almost never has
# (the space belongs to the next word's piece), so the model would be asked to continue something unseen.
SAMPLE_PROMPTS = ("def", "The", "import")
# Not instruction-tuned: the template only gives chat clients a well-formed prompt to continue.
CHAT_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """Everything a run depends on. Each field is also a flag (help below), so tests can skip absl."""

    out_dir: str = "models/default"
    seed: int = 0
    steps: int = 500
    minutes: float = 0.0
    vocab: int = 4096
    tokenizer_type: str = "bpe"
    layers: int = 4
    hidden: int = 256
    intermediate: int = 0
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    holdout_fraction: float = 0.05
    max_docs: int = 0
    max_source_files: int = 0
    eval_every: int = 100
    max_eval_windows: int = 256
    sample_tokens: int = 48


FLAG_HELP = {
    "out_dir": "Where the checkpoint, tokenizer and report go.",
    "seed": "Seeds the data split, batch order and initial weights.",
    "steps": "Optimizer steps (the cosine schedule spans them).",
    "minutes": "Stop training after this many minutes (0: no limit); a stop before --steps is not deterministic.",
    "vocab": "Sentencepiece vocabulary size (at least ~400: 256 byte pieces, 3 specials and the characters).",
    "tokenizer_type": "Sentencepiece model type: bpe or unigram.",
    "layers": "Decoder layers.",
    "hidden": "Hidden size.",
    "intermediate": "MLP size (0: 8/3 * hidden rounded up to a multiple of 64, Llama's ratio).",
    "heads": "Query heads.",
    "kv_heads": "Key/value heads.",
    "head_dim": "Per-head size.",
    "seq_len": "Training window in tokens; max_position_embeddings is twice this.",
    "batch_size": "Windows per step.",
    "lr": "Peak learning rate (linear warmup, cosine decay to a tenth of it).",
    "warmup_steps": "Linear warmup steps.",
    "weight_decay": "AdamW decay, on matrices only.",
    "clip_norm": "Global gradient-norm clip.",
    "holdout_fraction": "Share of documents held out for perplexity.",
    "max_docs": "Use only this many documents after the seeded shuffle (0: all); for quick runs and tests.",
    "max_source_files": "Read docstrings from only the first this many stdlib files, sorted (0: all); parsing "
                        "all of them takes seconds, so tests use this.",
    "eval_every": "Held-out evaluation every this many steps (0: only at the end).",
    "max_eval_windows": "Cap on held-out windows per evaluation (0: all).",
    "sample_tokens": "New tokens per sample generation.",
}
FLAGS = flags.FLAGS


def define_flags() -> None:
    """One flag per TrainOptions field. Only when run as a script: importing this module (the tests,
    heldout_task.py) must not claim flag names such as --seed that other modules define."""
    define = {str: flags.DEFINE_string, int: flags.DEFINE_integer, float: flags.DEFINE_float}
    for field in dataclasses.fields(TrainOptions):
        if field.name == "tokenizer_type":
            flags.DEFINE_enum(field.name, field.default, ["bpe", "unigram"], FLAG_HELP[field.name])
        else:
            define[field.type](field.name, field.default, FLAG_HELP[field.name])


def options_from_flags() -> TrainOptions:
    return TrainOptions(**{f.name: getattr(FLAGS, f.name) for f in dataclasses.fields(TrainOptions)})


# ---------------------------------------------------------------- corpus

def stdlib_python_files() -> list[str]:
    """Every .py file of the standard library's top-level modules and packages, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for name in sorted(sys.stdlib_module_names):
        path = os.path.join(root, name)
        if os.path.isdir(path):
            for directory, subdirs, names in os.walk(path):
                subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)  # sorted: walk order is fixed
                files += [os.path.join(directory, n) for n in sorted(names) if n.endswith(".py")]
        elif os.path.isfile(path + ".py"):
            files.append(path + ".py")
    return files


def module_name(path: str) -> str:
    rel = os.path.relpath(path, sysconfig.get_paths()["stdlib"]).removesuffix(".py")
    return rel.removesuffix("/__init__").replace(os.sep, ".")


def docstring_document(node, module: str) -> str | None:
    """A docstring framed as the code it documents, so prompts like "def " or "import " see their context."""
    doc = ast.get_docstring(node)
    if not doc:
        return None
    quoted = f'"""{doc}"""'
    if isinstance(node, ast.Module):
        return f"import {module}\n\n{quoted}"
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in node.bases)
        header = f"class {node.name}({bases}):" if bases else f"class {node.name}:"
    else:
        keyword = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
        header = f"{keyword} {node.name}({ast.unparse(node.args)}):"
    return header + "\n" + textwrap.indent(quoted, "    ")


def stdlib_docstrings(max_files: int = 0) -> list[str]:
    docs = []
    files = stdlib_python_files()
    for path in files[:max_files] if max_files else files:
        with open(path, "rb") as f:
            try:
                tree = ast.parse(f.read(), filename=path)
            except (SyntaxError, ValueError):  # a few stdlib files are templates, not Python
                continue
        module = module_name(path)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if (doc := docstring_document(node, module)) is not None:
                    docs.append(doc)
    return docs


def language_reference_topics() -> list[str]:
    from pydoc_data.topics import topics  # a plain dict of strings: the one module this script imports
    return [topics[key] for key in sorted(topics)]


def corpus_documents(max_source_files: int = 0) -> list[str]:
    """Topics then docstrings, exact duplicates dropped (so no held-out document is also a training one)."""
    return list(dict.fromkeys(language_reference_topics() + stdlib_docstrings(max_source_files)))


def split_documents(docs: list[str], holdout_fraction: float, max_docs: int, seed: int):
    """(train, held_out) after one seeded shuffle; at least one held-out document."""
    order = np.random.default_rng(seed).permutation(len(docs))
    if max_docs:
        order = order[:max_docs]
    num_held_out = max(1, round(len(order) * holdout_fraction))
    chosen = [docs[i] for i in order]
    return chosen[num_held_out:], chosen[:num_held_out]


# ---------------------------------------------------------------- tokenizer

def train_sentencepiece(docs: list[str], vocab_size: int, model_type: str) -> bytes:
    """Llama-2-style settings: byte fallback, identity normalisation, every space kept."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(docs), model_writer=model, model_type=model_type, vocab_size=vocab_size,
        byte_fallback=True, character_coverage=0.9995, split_digits=True, allow_whitespace_only_pieces=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
        # Whole documents are the "sentences" (newlines and indentation are part of the text to model).
        max_sentence_length=1 << 20, input_sentence_size=0, shuffle_input_sentence=False,
        num_threads=2, minloglevel=2)
    return model.getvalue()


def write_tokenizer_files(out_dir: str, sp_model: bytes, max_len: int) -> None:
    with open(os.path.join(out_dir, "tokenizer.model"), "wb") as f:
        f.write(sp_model)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False,
        "model_max_length": max_len,
        "chat_template": CHAT_TEMPLATE,
    })
    write_json(os.path.join(out_dir, "generation_config.json"),
               {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID})


def token_stream(tokenizer, docs: list[str]) -> np.ndarray:
    """All documents as one int32 stream, each BOS ... EOS (the serving tokenizer adds the BOS)."""
    ids = []
    for doc in docs:
        ids += tokenizer.encode(doc) + [EOS_ID]
    return np.asarray(ids, np.int32)


def windows(stream: np.ndarray, seq_len: int) -> np.ndarray:
    """[N, seq_len + 1] consecutive, non-overlapping inputs-plus-next-token windows (the tail is dropped)."""
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def batch_order(num_windows: int, batch_size: int, steps: int, seed: int) -> np.ndarray:
    """[steps, batch_size] window indices: a fresh seeded permutation per epoch, read straight through."""
    rng = np.random.default_rng(seed + 1)
    need = steps * batch_size
    epochs = [rng.permutation(num_windows) for _ in range(-(-need // num_windows))]
    return np.concatenate(epochs)[:need].reshape(steps, batch_size)


# ---------------------------------------------------------------- model and training forward

def model_config(opts: TrainOptions, vocab_size: int) -> ModelConfig:
    intermediate = opts.intermediate or 64 * math.ceil(opts.hidden * 8 / 3 / 64)  # Llama's SwiGLU ratio
    return ModelConfig(
        model_type="llama", vocab_size=vocab_size, hidden_size=opts.hidden, intermediate_size=intermediate,
        num_layers=opts.layers, num_heads=opts.heads, num_kv_heads=opts.kv_heads, head_dim=opts.head_dim,
        rms_norm_eps=1e-5, max_position_embeddings=2 * opts.seq_len,
        bos_token_id=BOS_ID, eos_token_ids=(EOS_ID,))


def causal_attention(attn, x, cos, sin, ctx):
    """x [B, S, hidden] -> [B, S, hidden]: the paged Attention's math, over whole sequences, no cache."""
    cfg = attn.cfg
    b, s, _ = x.shape
    groups = cfg.num_heads // cfg.num_kv_heads
    q, k, v = attn.project(x, ctx)  # [B, S, heads, D]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # cos/sin [S, D] broadcast over the batch
    # Query head h reads KV head h // groups (Hugging Face's repeat_kv order).
    q = q.reshape(b, s, cfg.num_kv_heads, groups, cfg.head_dim)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k).astype(jnp.float32) * cfg.query_scale
    if cfg.attn_logit_softcap:
        scores = cfg.attn_logit_softcap * jnp.tanh(scores / cfg.attn_logit_softcap)
    causal = jnp.tril(jnp.ones((s, s), bool))
    probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, s, cfg.num_heads * cfg.head_dim)
    return attn.o_proj(out, ctx)


def causal_lm_logits(model, tokens):
    """tokens [B, S] (each row from position 0) -> float32 logits [B, S, vocab]."""
    cfg = model.cfg
    x = model.embed_tokens(tokens)
    if cfg.scale_embeddings:
        x = x * jnp.asarray(cfg.hidden_size ** 0.5, x.dtype)
    cos, sin = rope_cos_sin(jnp.asarray(cfg.rope_inv_freq()), jnp.arange(tokens.shape[1]), x.dtype)

    def layer_step(layer, x, ctx):
        x = x + causal_attention(layer.self_attn, layer.input_layernorm(x, ctx), cos, sin, ctx)
        return x + layer.mlp(layer.post_attention_layernorm(x, ctx), ctx)

    # Plain jnp throughout (differentiable: no custom call), on whatever device trains
    ctx = ForwardContext(Kernels(jax.default_backend(), "reference", native=False))
    x = model.norm(model.scan_layers(layer_step, x, ctx), ctx)
    logits = model.embed_tokens.attend(x) if cfg.tie_word_embeddings else model.lm_head(x, ctx)
    logits = logits.astype(jnp.float32)
    if cfg.final_logit_softcap:
        logits = cfg.final_logit_softcap * jnp.tanh(logits / cfg.final_logit_softcap)
    return logits


def mean_next_token_loss(graphdef, state, batch):
    """batch [B, S + 1] -> mean cross-entropy (nats) of predicting tokens 1..S from their prefixes."""
    logits = causal_lm_logits(nnx.merge(graphdef, state), batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_optimizer(opts: TrainOptions) -> optax.GradientTransformation:
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=opts.lr, warmup_steps=min(opts.warmup_steps, max(opts.steps - 1, 1)),
        decay_steps=max(opts.steps, 2), end_value=opts.lr * 0.1)
    # Decay matrices only: norm weights are scales whose natural value is 1, not 0.

    def decay_mask(params):
        return jax.tree.map(lambda p: p.ndim >= 2, params)

    return optax.chain(
        optax.clip_by_global_norm(opts.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=opts.weight_decay, mask=decay_mask))


def make_train_step(graphdef, optimizer):
    @jax.jit
    def train_step(state, opt_state, batch):
        loss, grads = jax.value_and_grad(mean_next_token_loss, argnums=1)(graphdef, state, batch)
        updates, opt_state = optimizer.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss
    return train_step


def make_eval_loss(graphdef):
    @jax.jit
    def summed_loss(state, batch):
        logits = causal_lm_logits(nnx.merge(graphdef, state), batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).sum()

    def eval_loss(state, held_out: np.ndarray, batch_size: int) -> float:
        """Mean per-token loss over the held-out windows (the last partial batch included)."""
        total = 0.0
        for i in range(0, len(held_out), batch_size):
            total += float(summed_loss(state, held_out[i:i + batch_size]))
        return total / (len(held_out) * (held_out.shape[1] - 1))

    return eval_loss


def unigram_perplexity(train_stream: np.ndarray, held_out: np.ndarray, vocab_size: int) -> float:
    """Perplexity of add-one unigram frequencies from training: what a context-free model reaches."""
    counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
    log_probs = np.log(counts / counts.sum())
    return float(np.exp(-log_probs[held_out[:, 1:]].mean()))


# ---------------------------------------------------------------- generation through the paged path

def paged_greedy(loaded: LoadedModel, prompt: list[int], num_new: int, block_size: int = 16) -> list[int]:
    """Greedy continuation (stopping at EOS) through engine.worker.step.model_step and the paged KV cache."""
    cfg = loaded.cfg
    num_new = min(num_new, loaded.max_model_len - len(prompt))
    pages = -(-(len(prompt) + num_new) // block_size)
    cache = init_kv_cache(cfg.num_layers, 1 + pages, block_size, cfg.num_kv_heads, cfg.head_dim, loaded.dtype)
    table = list(range(1, 1 + pages))  # block 0 is the null block
    layout = StepLayout(bucket(len(prompt), 16), 1, pages, 1, decode=False)
    kernels = Kernels.for_platform(jax.default_backend(), loaded.dtype)
    logits, cache = model_step(loaded.graphdef, loaded.state, cache,
                               pack([SeqSlice(prompt, 0, table)], layout, block_size), layout, kernels)
    tokens = [int(np.argmax(logits[0]))]
    layout = StepLayout(1, 1, pages, 1, decode=True)
    while len(tokens) < num_new and tokens[-1] not in cfg.eos_token_ids:
        seq = SeqSlice([tokens[-1]], len(prompt) + len(tokens) - 1, table)
        logits, cache = model_step(loaded.graphdef, loaded.state, cache, pack([seq], layout, block_size), layout,
                                   kernels)
        tokens.append(int(np.argmax(logits[0])))
    return tokens


def sample_generations(out_dir: str, num_new: int) -> list[dict]:
    """Reload the written checkpoint and tokenizer, as a server would, and continue each sample prompt."""
    loaded, tokenizer = load_model(out_dir), load_tokenizer(out_dir)
    samples = []
    for prompt in SAMPLE_PROMPTS:
        ids = tokenizer.encode(prompt)
        new = paged_greedy(loaded, ids, num_new)
        # Decoded together with the prompt: alone, the first new piece would lose its leading space.
        text = tokenizer.decode(ids + new)
        samples.append({"prompt": prompt, "completion": text.removeprefix(prompt), "token_ids": new})
    return samples


# ---------------------------------------------------------------- the run

def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")


def param_count(state) -> int:
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(state)))


def train(opts: TrainOptions, command_line: list[str] | None = None) -> dict:
    """The whole run: corpus, tokenizer, training, checkpoint, samples; returns (and writes) the report."""
    started = time.time()
    os.makedirs(opts.out_dir, exist_ok=True)
    train_docs, held_out_docs = split_documents(corpus_documents(opts.max_source_files), opts.holdout_fraction,
                                                opts.max_docs, opts.seed)
    print(f"{len(train_docs)} training documents, {len(held_out_docs)} held out", flush=True)

    write_tokenizer_files(opts.out_dir, train_sentencepiece(train_docs, opts.vocab, opts.tokenizer_type),
                          2 * opts.seq_len)
    tokenizer = load_tokenizer(opts.out_dir)  # encode exactly as serving will
    train_stream, held_out_stream = token_stream(tokenizer, train_docs), token_stream(tokenizer, held_out_docs)
    train_windows = windows(train_stream, opts.seq_len)
    held_out_windows = windows(held_out_stream, opts.seq_len)
    if opts.max_eval_windows:
        held_out_windows = held_out_windows[:opts.max_eval_windows]
    if not len(train_windows) or not len(held_out_windows):
        raise ValueError(f"too little text for --seq_len={opts.seq_len}: {len(train_stream)} training and "
                         f"{len(held_out_stream)} held-out tokens")
    print(f"{len(train_stream)} training tokens ({len(train_windows)} windows), "
          f"{len(held_out_windows)} held-out windows", flush=True)

    cfg = model_config(opts, tokenizer.vocab_size)
    model = random_model(cfg, jnp.float32, seed=opts.seed)
    optimizer = make_optimizer(opts)
    state, opt_state = model.state, optimizer.init(model.state)
    train_step, eval_loss = make_train_step(model.graphdef, optimizer), make_eval_loss(model.graphdef)
    order = batch_order(len(train_windows), opts.batch_size, opts.steps, opts.seed)

    losses, eval_curve = [], []
    train_started = time.time()
    progress = tqdm(range(opts.steps), desc="train", dynamic_ncols=True)
    for step in progress:
        state, opt_state, loss = train_step(state, opt_state, train_windows[order[step]])
        losses.append(float(loss))
        progress.set_postfix(loss=f"{losses[-1]:.3f}")
        done = step + 1
        if opts.eval_every and done % opts.eval_every == 0 and done < opts.steps:
            eval_curve.append([done, eval_loss(state, held_out_windows, opts.batch_size)])
            progress.write(f"step {done}: held-out loss {eval_curve[-1][1]:.3f} "
                           f"(perplexity {math.exp(eval_curve[-1][1]):.1f})")
        if opts.minutes and time.time() - train_started > 60 * opts.minutes:
            progress.write(f"--minutes={opts.minutes} reached after {done} steps")
            break
    progress.close()
    train_seconds = time.time() - train_started
    held_out_loss = eval_loss(state, held_out_windows, opts.batch_size)
    eval_curve.append([len(losses), held_out_loss])

    model.state = state
    save_checkpoint(model, opts.out_dir)
    report = {
        "command_line": command_line if command_line is not None else sys.argv,
        "options": dataclasses.asdict(opts),
        "seed": opts.seed,
        "steps": len(losses),
        "stopped_early": len(losses) < opts.steps,
        "train_seconds": train_seconds,
        "steps_per_second": len(losses) / train_seconds,
        "tokens_per_step": opts.batch_size * opts.seq_len,
        "train_documents": len(train_docs),
        "held_out_documents": len(held_out_docs),
        "train_tokens": int(len(train_stream)),
        "held_out_tokens_evaluated": int(held_out_windows.shape[0] * opts.seq_len),
        "epochs": len(losses) * opts.batch_size / len(train_windows),
        "vocab_size": cfg.vocab_size,
        "param_count": param_count(state),
        "model_config": cfg.to_json(),
        "train_losses": losses,
        # Mean of the last 10 steps: a single step's loss is noisy.
        "final_train_loss": float(np.mean(losses[-10:])),
        "eval_curve": eval_curve,
        "held_out_loss": held_out_loss,
        "held_out_perplexity": math.exp(held_out_loss),
        "uniform_perplexity": cfg.vocab_size,
        "unigram_perplexity": unigram_perplexity(train_stream, held_out_windows, cfg.vocab_size),
    }
    report["samples"] = sample_generations(opts.out_dir, opts.sample_tokens)
    report["wall_seconds"] = time.time() - started
    write_json(os.path.join(opts.out_dir, "train_report.json"), report)
    print(f"held-out perplexity {report['held_out_perplexity']:.1f} (uniform {cfg.vocab_size}, unigram "
          f"{report['unigram_perplexity']:.1f}); {report['steps_per_second']:.2f} steps/s; "
          f"wrote {opts.out_dir}", flush=True)
    for sample in report["samples"]:
        print(f"  {sample['prompt']!r} -> {sample['completion']!r}")
    return report


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)  # JAX logs its backend probing at INFO
    train(options_from_flags())


if __name__ == "__main__":
    define_flags()
    app.run(main)
