"""What an execution provider costs the draft, against the CPU provider: the demo draft's one-token step and a
whole greedy generation of the demo pair with each provider's draft, interleaved (each provider once per repeat,
the order alternating), medians and their ratio. Usage (docs/npu.md):

    python scripts/provider_cost.py --providers '[{name: OpenVINOExecutionProvider, options: {device_type: CPU}}]'
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import yaml

from hetero_spec import Engine
from hetero_spec.config import load_config
from hetero_spec.onnx_decoder import OnnxDecoder
from hetero_spec.precision import resolve_draft

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "def read_lines(filename):\n    with open(filename) as f:\n"


def step_ms(decoder: OnnxDecoder, steps: int) -> float:
    state = decoder.new_state()
    decoder.append(state, list(range(3, 40)))
    started = time.perf_counter()
    for token in range(steps):
        decoder.append(state, [100 + token % 50])
    return (time.perf_counter() - started) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--providers", required=True, help="draft.providers to compare with [CPUExecutionProvider]")
    parser.add_argument("--config", default=str(ROOT / "configs/cpu-demo.yaml"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    arms = {"CPUExecutionProvider": ["CPUExecutionProvider"]}
    other = yaml.safe_load(args.providers)
    arms[other[0] if isinstance(other[0], str) else other[0]["name"]] = other
    fixed = {"runtime.mode": "in_process", "runtime.cpus": None, "speculation.gamma": 4, "target.threads": 1}
    configs = {name: resolve_draft(load_config(args.config, {**fixed, "draft.providers": providers}))
               for name, providers in arms.items()}
    decoders = {name: OnnxDecoder(cfg.draft.model, providers=cfg.draft.providers) for name, cfg in configs.items()}
    engines = {name: Engine(cfg) for name, cfg in configs.items()}
    steps: dict[str, list[float]] = {name: [] for name in arms}
    rates: dict[str, list[float]] = {name: [] for name in arms}
    outputs: dict[str, list[int]] = {}
    for repeat in range(args.repeats):
        for name in list(arms)[:: 1 if repeat % 2 == 0 else -1]:
            steps[name].append(step_ms(decoders[name], args.steps))
            out = engines[name].generate(PROMPT, max_new_tokens=96, temperature=0.0)
            rates[name].append(out.stats["tokens_per_s"])
            outputs[name] = out.token_ids
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)
    base, name = "CPUExecutionProvider", list(arms)[1]
    print(f"\n| draft provider | draft step (ms, median) | step vs CPU | demo pair tok/s (median) | tok/s vs CPU |")
    print("|---|---|---|---|---|")
    for arm in arms:
        step, rate = statistics.median(steps[arm]), statistics.median(rates[arm])
        print(f"| {arm} | {step:.3f} | {step / statistics.median(steps[base]):.2f}x | {rate:.0f} | "
              f"{rate / statistics.median(rates[base]):.2f}x |")
    print(f"\ngreedy outputs identical: {outputs[base] == outputs[name]}; "
          f"{name} in use: {decoders[name].session.get_providers()[0] == name}")
    for engine in engines.values():
        engine.close()


if __name__ == "__main__":
    main()
