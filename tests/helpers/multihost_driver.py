"""One process of a two-process (loopback) tensor-parallel run, for tests/engine/test_parallel.py:

    python tests/helpers/multihost_driver.py PROCESS_ID PORT MODEL_DIR OUT_JSON

Each process has one CPU device; the mesh spans both. Process 0 leads (LLM.generate over the prompts in
OUT_JSON's sibling job file) and writes the token ids; process 1 follows until the leader stops it."""

import json
import sys

from engine.config import EngineConfig
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.worker.multihost import CallChannel, DistributedConfig, follow, initialize, lead

TIMEOUT_S = 60


def main(process_id: int, port: int, model_dir: str, job_path: str):
    initialize(DistributedConfig(f"127.0.0.1:{port}", 2, process_id, timeout_s=TIMEOUT_S))
    job = json.load(open(job_path))
    config = EngineConfig(**job["config"], tensor_parallel_size=2)
    channel = CallChannel()
    if process_id:
        follow(LLMEngine(model_dir, config).runner, channel)
        return
    llm = LLM(model_dir, config)
    lead(llm.engine, channel)
    try:
        outs = llm.generate(job["prompts"], SamplingParams(temperature=0, max_tokens=job["max_tokens"],
                                                           ignore_eos=True), use_tqdm=False)
    finally:
        channel.close()
    stats = llm.engine.stats()
    json.dump({"tokens": [o.outputs[0].token_ids for o in outs], "preemptions": stats["preemptions"]},
              open(job["out"], "w"))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
