"""vLLM as a benchmark peer, driven line by line by scripts/benchmark_throughput.py (its `vllm` backend).

Runs under vLLM's own interpreter (a separate venv: vLLM pins its own torch), so it imports nothing
from Ferry. Started as `VLLM_PYTHON vllm_worker.py '<json engine args>'`; then each stdin line is one
JSON command and each answer one JSON line on the original stdout (vLLM's own logging goes to stderr):

  {"op": "generate", "prompts": [[token ids], ...], "output_lens": [n, ...]}
      -> {"elapsed_s": s, "produced": [tokens each request got, ...]}     greedy, EOS ignored
  {"op": "single", "prompt": [token ids], "output_len": n}
      -> {"ttft_s": s, "total_s": s, "produced": n}   first token timed by a separate max_tokens=1 run
  {"op": "quit"}

The answer to the engine args line is {"ready": true, "load_s": s, "vllm_version": ...}.
"""

import json
import os
import sys
import time


def protocol_channel():
    """The original stdout for answers; fd 1 then points at stderr, so nothing vLLM prints can
    interleave with an answer."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    return out


def greedy(vllm, output_len: int):
    return vllm.SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len, ignore_eos=True,
                               detokenize=False)


def generate(llm, vllm, prompts, output_lens):
    """Every prompt at once, from an empty prefix cache (as Ferry's runs start: otherwise every prompt
    after the warm-up pass hits the cache and skips its prefill); (elapsed seconds, output tokens per
    request, in order)."""
    inputs = [{"prompt_token_ids": p} for p in prompts]
    params = [greedy(vllm, n) for n in output_lens]
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache")
    t0 = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return elapsed, [len(o.outputs[0].token_ids) for o in outs]


def main() -> int:
    answers = protocol_channel()
    args = json.loads(sys.argv[1])
    import vllm

    t0 = time.perf_counter()
    llm = vllm.LLM(skip_tokenizer_init=True, **args)  # token-id prompts: no tokenizer needed
    answers.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0,
                              "vllm_version": vllm.__version__}) + "\n")
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        if cmd["op"] == "generate":
            elapsed, produced = generate(llm, vllm, cmd["prompts"], cmd["output_lens"])
            answer = {"elapsed_s": elapsed, "produced": produced}
        elif cmd["op"] == "single":
            ttft, _ = generate(llm, vllm, [cmd["prompt"]], [1])
            total, produced = generate(llm, vllm, [cmd["prompt"]], [cmd["output_len"]])
            answer = {"ttft_s": ttft, "total_s": total, "produced": produced[0]}
        else:
            answer = {"error": f"unknown op {cmd['op']!r}"}
        answers.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
