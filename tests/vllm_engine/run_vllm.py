"""Runs a real vLLM engine (in the ``.venv-vllm`` virtualenv, never the project's own).

    python run_vllm.py make-model DIR          # a tiny Llama with weights of a real scale
    python run_vllm.py run SPEC.json OUT.json  # phases of prompts through one engine
    python run_vllm.py serve SPEC.json         # phases as JSON lines on stdin (benchmarks)

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the connector's
scheduler and worker halves, and their counters, are reachable between phases. A phase may
set a fault of ``faulty.FaultyConnector`` (tests only) and reset vLLM's own prefix cache,
which makes the next phase a cold engine as far as vLLM's cache goes. Its prompts go to vLLM
together (one ``generate``, batched as the engine likes) or, with ``one_by_one``, each after
the one before: a stream of requests.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("PYTHONHASHSEED", "0")

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 512, 128, 2, 4, 2, 32, 256
BLOCK_SIZE = 32


def make_model(out: Path) -> None:
    """A 2-layer Llama whose attention matters: normal weights (std 0.08, embeddings 0.5),
    so that wrong KV changes the logits (vLLM's ``dummy`` weights are too small for that)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "max_position_embeddings": 16384,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(1234)

    def normal(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    weights = {
        "model.embed_tokens.weight": normal(VOCAB, HIDDEN, std=0.5),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": normal(VOCAB, HIDDEN),
    }
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": normal(FFN, HIDDEN),
            p + "mlp.up_proj.weight": normal(FFN, HIDDEN),
            p + "mlp.down_proj.weight": normal(HIDDEN, FFN),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))


def _connectors(llm: Any) -> tuple[Any, Any]:
    """The scheduler-side and worker-side connector instances of an in-process engine."""
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )

    core = llm.llm_engine.engine_core.engine_core
    scheduler = core.scheduler.get_kv_connector()
    worker = get_kv_transfer_group() if has_kv_transfer_group() else None
    return scheduler, worker


def pool_metrics(metrics_url: str, names: list[str]) -> dict[str, float | None]:
    """Sums over the label sets of the agent's labelled counters ``names`` (None each when it
    does not answer)."""
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as reply:
            text = reply.read().decode()
    except OSError:
        return dict.fromkeys(names)
    lines = text.splitlines()
    return {
        name: sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name + "{"))
        for name in names
    }


TIMELINE: list[tuple[str, float]] = []
"""With a spec's ``timeline`` (benchmarks): what the worker-side connector did, and when
(``time.perf_counter``), in the order it happened; ``run_phase`` hands each phase its part."""


def _record_timeline() -> None:
    """Time the worker-side connector's steps and saves into ``TIMELINE`` (dev tooling: it
    wraps the connector's methods, private ones included, in this process only):

    - ``step`` / ``step_end``: ``bind_connector_metadata`` is called before a step's forward
      pass, and ``wait_for_save`` returns after it (with the step's saves queued);
    - ``queued``: a save was queued for the sender thread (``SaveQueue.put`` took it);
    - ``save`` / ``save_end``: the sender thread sent one (``_send_save``)."""
    from kvpool_agent.connectors.saves import SaveQueue
    from kvpool_agent.connectors.vllm.connector import KvpoolConnector

    def wrap(cls: Any, name: str, before: str | None, after: str | None) -> None:
        inner = getattr(cls, name)

        def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
            if before is not None:
                TIMELINE.append((before, time.perf_counter()))
            try:
                return inner(self, *args, **kwargs)
            finally:
                if after is not None:
                    TIMELINE.append((after, time.perf_counter()))

        setattr(cls, name, timed)

    wrap(KvpoolConnector, "bind_connector_metadata", "step", None)
    wrap(KvpoolConnector, "wait_for_save", None, "step_end")
    wrap(KvpoolConnector, "_send_save", "save", "save_end")
    put = SaveQueue.put

    def queued(self: Any, save: Any) -> bool:
        at = time.perf_counter()
        taken = put(self, save)
        if taken:  # a save the full queue refused is never sent
            TIMELINE.append(("queued", at))
        return taken

    SaveQueue.put = queued  # type: ignore[method-assign]


def start_engine(spec: dict[str, Any]) -> Any:
    """An in-process ``LLM`` for ``spec`` (model, connector or None, max_model_len).
    ``python_exchange`` (benchmarks) has the connector's same-node PUTs run their exchange
    in Python instead of ``kvpool_native.shm_put``, as without the compiled core;
    ``timeline`` (benchmarks) records the connector's steps and saves (``_record_timeline``)
    into each phase's record."""
    sys.path.insert(0, str(HERE))
    from vllm import LLM
    from vllm.config import KVTransferConfig

    if spec.get("python_exchange"):
        from kvpool_agent.dataplane import shm

        shm._shm_put = None
    if spec.get("timeline"):
        _record_timeline()

    kwargs: dict[str, Any] = {}
    connector = spec.get("connector")
    if connector is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=connector["class"],
            kv_connector_module_path=connector["module"],
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=connector["extra"],
        )
    if spec.get("kv_events_endpoint"):
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=spec["kv_events_endpoint"],
            topic="kv@vllm@tiny-llama",
        )
    return LLM(
        model=spec["model"],
        served_model_name=spec.get("served_model_name", "tiny-llama"),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        max_model_len=spec.get("max_model_len", 1024),
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        max_num_seqs=8,
        seed=0,
        **kwargs,
    )


def phase_prompts(phase: dict[str, Any], earlier: dict[str, dict[str, Any]]) -> list[list[int]]:
    """The phase's ``prompts``, or with ``extend`` (``{"from": PHASE, "take": N, "extra":
    [...]}``) each prompt of an earlier phase followed by the first N tokens it generated and
    ``extra``: a next turn that repeats the answer."""
    ext = phase.get("extend")
    if ext is None:
        return list(phase["prompts"])
    before = earlier[ext["from"]]
    return [
        list(prompt) + out["tokens"][: ext["take"]] + list(ext["extra"])
        for prompt, out in zip(before["prompts"], before["outputs"], strict=True)
    ]


def process_cpu_s() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def minor_faults() -> int:
    """Page faults of this process so far that needed no disk (fresh or shared pages)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def run_phase(
    llm: Any, spec: dict[str, Any], phase: dict[str, Any], earlier: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """One ``generate`` of the phase's prompts (after its reset and fault), and what it gave
    (``earlier``: the records of the phases before, by name)."""
    from vllm import SamplingParams

    has_connector = spec.get("connector") is not None
    kv_params = phase.get("kv_transfer_params")
    params = SamplingParams(
        temperature=0.0,
        max_tokens=phase.get("max_tokens", spec.get("max_tokens", 4)),
        logprobs=1,
        # A request's own connector settings, as the OpenAI server's `kv_transfer_params`.
        extra_args=None if kv_params is None else {"kv_transfer_params": kv_params},
    )
    scheduler, worker = _connectors(llm) if has_connector else (None, None)
    if phase.get("reset"):
        assert llm.reset_prefix_cache(), "vLLM did not reset its prefix cache"
    fault = phase.get("fault")
    if fault is not None:
        from faulty import FaultyConnector

        FaultyConnector.configure(fault, phase.get("fault_args", {}))
    prompts = [{"prompt_token_ids": ids} for ids in phase_prompts(phase, earlier)]
    cpu0, faults0 = process_cpu_s(), minor_faults()
    mark = len(TIMELINE)
    t0 = time.monotonic()
    if phase.get("one_by_one"):  # a stream of requests, each after the one before
        outputs = [o for p in prompts for o in llm.generate([p], params, use_tqdm=False)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.monotonic() - t0
    if worker is not None:
        assert worker.flush(60.0), "the connector's saves did not finish"
    record: dict[str, Any] = {
        "name": phase["name"],
        "prompts": [p["prompt_token_ids"] for p in prompts],
        "elapsed_s": elapsed,
        # Until the phase's saves were in the pool as well.
        "flushed_s": time.monotonic() - t0,
        # This process's CPU time (every thread), the phase's saves included: what it took
        # from a shared machine's cores, whatever else ran there meanwhile.
        "cpu_s": process_cpu_s() - cpu0,
        "minor_faults": minor_faults() - faults0,
        "outputs": [
            {
                "tokens": list(o.outputs[0].token_ids),
                "logprobs": [
                    lp[tok].logprob
                    for tok, lp in zip(
                        o.outputs[0].token_ids, o.outputs[0].logprobs or [], strict=True
                    )
                ],
                "num_cached_tokens": o.num_cached_tokens,
            }
            for o in outputs
        ],
    }
    if spec.get("pool_metrics"):
        found = pool_metrics(
            spec["pool_metrics"],
            ["kvpool_prefix_cache_hits_tokens_total", "kvpool_transfer_bytes_total"],
        )
        record["pool_hits_tokens"] = found["kvpool_prefix_cache_hits_tokens_total"]
        record["pool_transfer_bytes"] = found["kvpool_transfer_bytes_total"]
    if scheduler is not None:
        record["scheduler_stats"] = scheduler.stats.snapshot()
    if worker is not None:
        record["worker_stats"] = worker.stats.snapshot()
    if spec.get("timeline"):
        record["timeline"] = TIMELINE[mark:]
    return record


def run(spec_path: Path, out_path: Path) -> None:
    """Every phase of the spec in order; the result document is rewritten after each."""
    spec = json.loads(spec_path.read_text())
    started = time.monotonic()
    llm = start_engine(spec)
    result: dict[str, Any] = {"startup_s": time.monotonic() - started, "phases": []}
    earlier: dict[str, dict[str, Any]] = {}
    for phase in spec["phases"]:
        record = run_phase(llm, spec, phase, earlier)
        earlier[phase["name"]] = record
        result["phases"].append(record)
        out_path.write_text(json.dumps(result))
    # The engine's process-wide state is torn down by exit; nothing runs after this.
    os._exit(0)


RESULT = "KVPOOL-RESULT "


def serve(spec_path: Path) -> None:
    """Phases read one JSON line at a time from stdin, each answered by a stdout line
    ``KVPOOL-RESULT <json>`` (a benchmark alternates two engines request by request); an
    empty line ends it. ``KVPOOL-READY`` is printed once the engine is up."""
    spec = json.loads(spec_path.read_text())
    llm = start_engine(spec)
    print("KVPOOL-READY", flush=True)
    earlier: dict[str, dict[str, Any]] = {}
    for line in sys.stdin:
        if not line.strip():
            break
        phase = json.loads(line)
        record = run_phase(llm, spec, phase, earlier)
        earlier[phase["name"]] = record
        print(RESULT + json.dumps(record), flush=True)
    os._exit(0)


if __name__ == "__main__":
    if sys.argv[1] == "make-model":
        make_model(Path(sys.argv[2]))
    elif sys.argv[1] == "run":
        run(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1] == "serve":
        serve(Path(sys.argv[2]))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]!r}")
