"""One runner for a builder-exported decoder (onnxruntime-genai) with a rollback-able KV cache, for the ONNX drafter
and the ONNX target; never imports torch. Inputs: `input_ids`, `attention_mask` (total length), maybe `position_ids`,
`past_key_values.N.key/value` [batch, kv_heads, past, head_dim]; outputs: `logits`, `present.N.key/value`. Each
request's cache is a `DecoderState`. The shared (in-place, `past_present_share_buffer`) and copy cache layouts:
docs/architecture.md ("onnx"); the shared one costs 25 % less per step at a 1000-token context (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
import statistics
import time
import weakref
from dataclasses import dataclass, field
from typing import Any
from pathlib import Path

import numpy as np
import onnxruntime as ort

from . import kernels as kernels_mod
from .draft.export import RUNNER_MODEL
from .draft.head import HEAD_TOKENS
from .errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

_ORT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


#: plugin execution providers, loaded from their package's library (onnxruntime.register_execution_provider_library)
PLUGIN_EPS = {"OpenVINOExecutionProvider": ("onnxruntime_ep_openvino", "onnxruntime-ep-openvino")}


@dataclass
class SessionProviders:
    """What an InferenceSession is given for a providers list (resolve_providers): `classic` (name, options) pairs,
    or a plugin EP's `devices` and their `options`; `expected`, the provider the session must report first; `notes`,
    the fallbacks taken (logged; /health and the stats show them)."""

    classic: list[tuple[str, dict[str, str]]]
    devices: list[Any] = field(default_factory=list)
    options: dict[str, str] = field(default_factory=dict)
    expected: str = "CPUExecutionProvider"
    notes: list[str] = field(default_factory=list)

    def apply(self, opts: ort.SessionOptions) -> dict[str, Any]:
        """The InferenceSession keyword arguments; a plugin EP's devices are added to opts."""
        if self.devices:
            opts.add_provider_for_devices(self.devices, self.options)
            return {}
        return {"providers": self.classic}


def _plugin_installed(name: str) -> bool:
    return importlib.util.find_spec(PLUGIN_EPS[name][0]) is not None


@functools.cache
def _plugin_devices(name: str) -> tuple[list[Any], str]:
    """A plugin EP's devices on this machine, registered once per process; no devices: why not."""
    module, package = PLUGIN_EPS[name]
    try:
        library = importlib.import_module(module).get_library_path()
    except ImportError:
        return [], f"its plugin is not installed (pip install {package})"
    try:
        ort.register_execution_provider_library(name, library)
    except Exception as exc:  # onnxruntime raises its own exception types
        return [], f"its plugin ({library}) did not load: {' '.join(str(exc).split())}"
    devices = [d for d in ort.get_ep_devices() if d.ep_name == name]
    here = ", ".join(f"{d.device.type.name} ({d.device.vendor})" for d in ort.get_ep_devices()
                     if d.ep_name == "CPUExecutionProvider")
    return devices, "" if devices else f"its plugin offers no device on this machine (devices here: {here})"


def _probe_model() -> bytes:
    """A one-node ONNX model: a session on it tries the providers and their options without loading a model."""
    from onnx import TensorProto, helper
    x, y = (helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in "xy")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8).SerializeToString()


def resolve_providers(entries: list, source: str = "<config>", key: str = "draft.providers") -> SessionProviders:
    """The session's providers for `draft.providers`/`target.providers` (names or config.ProviderEntry), checked
    before any model loads: a provider this onnxruntime does not know, one not available here (unless its entry
    says `fallback: cpu`), a device its plugin does not offer or an option it refuses is a ConfigError naming it."""
    from .config import ProviderEntry
    available, known = ort.get_available_providers(), ort.get_all_providers()
    if not entries:
        raise ConfigError(source, key, entries, f"at least one provider is needed; available: {', '.join(available)}")
    entries = [ProviderEntry(name=e) if isinstance(e, str) else ProviderEntry.model_validate(e) for e in entries]
    out = SessionProviders(classic=[])
    for i, entry in enumerate(entries):
        where, options = f"{key}[{i}]", {k: str(v).lower() if isinstance(v, bool) else str(v)
                                         for k, v in entry.options.items()}
        devices, why = [], ""
        # a plugin EP goes through its devices, even once registered (then onnxruntime lists it as available)
        if entry.name in PLUGIN_EPS and (entry.name not in available or _plugin_installed(entry.name)):
            devices, why = _plugin_devices(entry.name)
            devices = [d for d in devices if entry.device is None or d.device.type.name.lower() == entry.device]
            why = why or (f"its plugin offers no {entry.device} device here" if not devices else "")
        elif entry.name not in known:
            raise ConfigError(source, where, entry.name, f"unknown execution provider; onnxruntime {ort.__version__} "
                              f"knows: {', '.join(known)}")
        elif entry.name not in available:
            why = f"not in this onnxruntime build ({ort.__version__})"
        elif entry.device is not None:
            raise ConfigError(source, f"{where}.device", entry.device, "only a plugin execution provider chooses "
                              "among devices; give the provider's own option (OpenVINO: options.device_type)")
        if why and entry.fallback != "cpu":
            plugins = ", ".join(f"{n} (pip install {p})" for n, (_, p) in PLUGIN_EPS.items())
            raise ConfigError(source, where, entry.name, f"execution provider not available: {why}; available: "
                              f"{', '.join(available)}; plugins: {plugins}; or add fallback: cpu to the entry")
        if why:
            out.notes.append(f"{entry.name} not available ({why}): {key} fell back to CPUExecutionProvider")
            log.warning("%s", out.notes[-1])
        elif devices and not out.devices and not out.classic:
            out.devices, out.options, out.expected = devices, options, entry.name
        elif not out.devices:
            out.classic.append((entry.name, options))
    if not out.devices:
        out.classic = out.classic or [("CPUExecutionProvider", {})]
        out.expected = out.classic[0][0]
    _probe(out, entries, source, key)
    return out


def _probe(providers: SessionProviders, entries: list, source: str, key: str) -> None:
    """A session on the one-node model with these providers: what onnxruntime refuses, or silently drops, is the
    config's error now, not a fallback found later."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    where = f"{key}[0]" if len(entries) == 1 else key
    try:
        session = ort.InferenceSession(_probe_model(), sess_options=opts, enable_fallback=0, **providers.apply(opts))
    except Exception as exc:  # onnxruntime raises its own exception types; its C++ source location goes
        why = re.sub(r"^\S+\.cc:\d+ .*?\) ", "", " ".join(str(exc).split()))
        names = [e.name for e in entries]
        raise ConfigError(source, where, names[0] if len(names) == 1 else names, f"onnxruntime refused it: {why}") \
            from None
    if session.get_providers()[0] != providers.expected:
        raise ConfigError(source, where, providers.expected, f"onnxruntime could not start it with these options "
                          f"(its error is logged above) and ran {session.get_providers()[0]} instead")
    # a provider that reports its options (CUDA's, and the CPU provider's: none) ignores one it does not take
    taken, classic = session.get_provider_options(), dict(providers.classic)
    for i, entry in enumerate(entries):
        name, options = entry.name, entry.options
        reported = taken.get(name) if name in classic else None
        if (reported or name == "CPUExecutionProvider") and (unknown := sorted(set(options) - set(reported or {}))):
            takes = ", ".join(sorted(reported or {})) or "none"
            raise ConfigError(source, f"{key}[{i}].options", unknown[0], f"not an option of {name} (it takes: {takes})")


def check_providers(providers: list, source: str = "<config>", key: str = "draft.providers") -> None:
    """resolve_providers for its errors alone (preflight)."""
    resolve_providers(providers, source, key)


@dataclass
class DecoderState:
    """One sequence's KV cache: `cache` arrays holding `n_past` positions (shared layout: the first n_past of
    `capacity`; copy layout: exactly n_past). `binding` is the state's IO binding (shared layout)."""

    cache: list[np.ndarray] = field(default_factory=list)
    n_past: int = 0
    binding: Any = None
    # shared layout: the KvPool whose slot it is (a batched buffer's, or a pool of one slot of its own); copy: None
    pool: KvPool | None = None
    slot: int = -1
    # shared layout, one-token steps: input_ids, position_ids and logits buffers bound to `binding` once and
    # rewritten each step; None until the first step, and after a several-token run or a new binding
    step: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    # shared layout: the attention mask [1, capacity], as wide as the buffers and bound with them: ones over the first
    # `mask_ones` positions, zeros after (GroupQueryAttention reads the lengths from its sum, not its width), so a
    # step writes one element instead of binding a new, longer mask
    mask: np.ndarray | None = None
    mask_ones: int = 0

    @property
    def capacity(self) -> int:
        return self.cache[0].shape[2] if self.cache else 0

    @property
    def n_cached(self) -> int:  # the verifier interface's name (target/base.py): the ONNX target's state is this
        return self.n_past


class OnnxDecoder:
    """A builder-exported decoder in a plain InferenceSession. `vocab_width` pads or cuts the logits to
    the width the caller works in (the target's vocabulary)."""

    #: first buffer size of the shared layout (positions); it doubles as needed, up to the context
    initial_capacity = 256

    def __init__(self, model_dir: Path, providers: list[str] | None = None, threads: int = 1,
                 vocab_width: int | None = None, role: str = "draft", shared_buffer: bool | None = None,
                 spin: bool | str = True, prefill_threads: int | None = None, block_dir: Path | None = None,
                 kernels: str = "onnxruntime"):
        model_dir = Path(model_dir)
        # draft/export.add_runner_graph's graph, else the export's own
        path = next((p for p in (model_dir / RUNNER_MODEL, model_dir / "model.onnx") if p.is_file()), None)
        if path is None:
            raise ModelLoadError(f"{role} model directory {str(model_dir)!r} has no model.onnx (an export: "
                                 "`hetero-spec export --model HF_DIR --out DIR`)")
        providers = resolve_providers(providers or ["CPUExecutionProvider"], key=f"{role}.providers")
        self.provider_notes = providers.notes  # fallbacks taken (entries with fallback: cpu)
        # runtime.kernels: the export's 4-bit matmuls on hetero_spec's Q4Rows (kernels/q4rows.c), a graph of the
        # same weights repacked once into the cache; `path` itself where ONNX Runtime's MatMulNBits runs them
        self.graph_path = kernels_mod.graph_for(path, kernels, providers.expected, role)
        self.kernels = "onnxruntime" if self.graph_path == path else "hetero_spec"
        path = self.graph_path
        self.session = self._load(path, providers, threads, spin, role, q4rows=self.kernels == "hetero_spec")
        # prefill_threads > threads: a second session over the same KV buffers for runs marked wide (a prompt's
        # prefill): in two processes the worker's core is mostly free during the prompt (docs/features-two-process.md).
        # Its pool threads never spin: after the prefill the other core is the worker's.
        self.prefill_threads = prefill_threads if prefill_threads and prefill_threads > threads else None
        self._wide = self._load(path, providers, self.prefill_threads, False, role,
                                q4rows=self.kernels == "hetero_spec") if self.prefill_threads else None
        self.model_dir = model_dir
        self._setup_io(model_dir)
        # block_dir: a second graph of the same weights in another format over the same KV cache (target.block_graph),
        # for runs of at least block_from tokens (choose_block_from: where it is the faster); None: one graph
        self._block, self.block_from = None, None
        if block_dir is not None:
            self._block = self._load(Path(block_dir) / "model.onnx", providers, threads, spin, role)
            if {i.name for i in self._block.get_inputs()} != self.input_names:
                raise ModelLoadError(f"{role} block graph {str(block_dir)!r} does not take the inputs of "
                                     f"{str(model_dir)!r}: it must be made from the same model")
        self.vocab_width = vocab_width or self.model_vocab
        # fit_width's scatter (logit i goes to column _head_cols[i]), worked out once: it runs every draft step
        if self.head_tokens is not None:
            self._head_in = self.head_tokens < self.vocab_width
            self._head_cols = self.head_tokens[self._head_in]
        else:  # the model's columns first, -inf after them
            self._head_in, self._head_cols = slice(None), slice(0, self.head_width)
        declared = bool(self.search_config.get("past_present_share_buffer")) and bool(self.past_names)
        on_cpu = self.session.get_providers()[0] == "CPUExecutionProvider"
        self.shared = (declared and on_cpu) if shared_buffer is None else (shared_buffer and declared)
        self.layout = "shared" if self.shared else "copy"

    @staticmethod
    def _load(path: Path, providers: SessionProviders, threads: int, spin: bool | str, role: str,
              q4rows: bool = False):
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads, opts.log_severity_level = threads, 1, 3
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        if threads > 1 and spin == "run":
            # spin while a run lasts (without, each operator's work wakes the pool threads: demo target, 2 threads,
            # 1.3x a step), and stop as it returns: spinning after a run takes the cores the next session (draft
            # or target) needs (demo pair on 2 cores, both at 2 threads: a round of 4 drafts + verify 17.0 -> 9.2 ms)
            opts.add_session_config_entry("session.force_spinning_stop", "1")
        elif threads > 1 and not spin:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            if q4rows:  # a graph with hetero_spec's own kernel (kernels/q4rows.c)
                opts.register_custom_ops_library(str(kernels_mod.library()))
            session = ort.InferenceSession(str(path), sess_options=opts, enable_fallback=0, **providers.apply(opts))
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ModelLoadError(f"cannot load {role} model {str(path)!r}: {exc}") from exc
        if session.get_providers()[0] != providers.expected:  # onnxruntime falls back without a word
            raise ModelLoadError(f"{role} model {str(path)!r}: onnxruntime ran it on {session.get_providers()[0]}, "
                                 f"not {providers.expected}")
        return session

    def _setup_io(self, model_dir: Path) -> None:
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = sorted((n for n in inputs if n.startswith("past_key_values.")),
                                 key=lambda n: (int(n.split(".")[1]), n.endswith("value")))
        self.present_names = [n.replace("past_key_values.", "present.") for n in self.past_names]
        self.input_names = set(inputs)
        # `logits_from` [1] (export.add_logits_from): logits from that position on, so a prefill or a catch-up pays
        # the LM head for its last position only
        self.has_logits_from = "logits_from" in inputs
        # `position_ids` and `attention_bias` wired into the attention (export.add_tree_inputs): a pass can verify a
        # token tree (append_tree); every run then feeds a bias, zeros where nothing is masked
        self.has_tree = "attention_bias" in inputs and "position_ids" in inputs
        self.bias_dtype = _ORT_DTYPES.get(inputs["attention_bias"].type, np.float32) if self.has_tree else None
        self._zero = np.zeros(1, dtype=np.int64)  # logits_from of a run that wants every position (stays bound)
        first = inputs[self.past_names[0]] if self.past_names else None
        genai_path = model_dir / "genai_config.json"
        raw = json.loads(genai_path.read_text()) if genai_path.is_file() else {}
        self.genai_config, self.search_config = raw.get("model", {}), raw.get("search", {})
        decoder = self.genai_config.get("decoder", {})
        kv_heads = decoder.get("num_key_value_heads") or (first.shape[1] if first is not None else 0)
        head_dim = decoder.get("head_size") or (first.shape[3] if first is not None else 0)
        if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
            raise ModelLoadError(f"{model_dir}: cannot tell the KV cache shape (no genai_config.json)")
        self.kv_shape = (1, kv_heads, 0, head_dim)
        self.kv_dtype = _ORT_DTYPES.get(first.type, np.float32) if first is not None else np.float32
        logits_out = next(o for o in self.session.get_outputs() if o.name == "logits")
        width = logits_out.shape[-1]
        self.head_width = int(width) if isinstance(width, int) else int(self.genai_config.get("vocab_size", 0))
        # a pruned LM head (draft/head.py): logit i is token head_tokens[i]; the model's vocabulary is the
        # tokenizer's, the logits are spread into it (-inf for the tokens the head does not propose)
        self.head_tokens = np.load(model_dir / HEAD_TOKENS) if (model_dir / HEAD_TOKENS).is_file() else None
        self.model_vocab = (self.head_width if self.head_tokens is None
                            else int(self.genai_config.get("vocab_size") or self.head_tokens.max() + 1))
        self.logits_dtype = _ORT_DTYPES.get(logits_out.type, np.float32)
        self._ones = np.ones((1, 256), dtype=np.int64)
        self.context_len = int(self.genai_config.get("context_length") or 1 << 30)

    def new_state(self) -> DecoderState:
        """A fresh state (shared layout: the slot of a pool of its own, which grows as any pool does)."""
        return KvPool(self, 1).acquire() if self.shared else DecoderState()

    def append(self, state: DecoderState, tokens: list[int], wide: bool = False, last_only: bool = False,
               scratch: bool = False) -> np.ndarray:
        """Run tokens after the state's cached past; returns logits [len(tokens), vocab_width], or [1, vocab_width]
        for the last token with last_only (computed for it alone where the graph has `logits_from`). wide: a run of
        several tokens goes to the prefill session (prefill_threads), when there is one. scratch: the caller reads
        the logits before the state's next run, so a one-token step may return its bound output buffer itself
        (no copy: on the demo target the copy was a third of the Python a step costs)."""
        n_new, total = len(tokens), state.n_past + len(tokens)
        if n_new == 1 and self.shared:
            return self._step_shared(state, tokens[0], scratch)
        rows = 1 if last_only and self.has_logits_from else n_new
        feeds = {"input_ids": np.asarray([tokens], dtype=np.int64),
                 "position_ids": np.arange(state.n_past, total, dtype=np.int64)[None],
                 "logits_from": np.asarray([n_new - rows], dtype=np.int64)}
        logits = self._run(state, feeds, rows, self._session_for(n_new, wide))
        state.n_past += n_new
        return self.fit_width(logits[0, -1:] if last_only else logits[0])

    def append_tree(self, state: DecoderState, tokens: list[int], parents: list[int]) -> np.ndarray:
        """Run a token tree after the state's past in one pass (a graph with has_tree): tokens[i]'s parent is
        tokens[parents[i]] (parents[i] < i), or the cached past where parents[i] is -1. Each token takes the position
        of its depth and attends to the past and its own ancestors only, so its logits are those of the chain from
        the root to it. Returns logits [len(tokens), vocab_width]. The cache holds every token at n_past + its index:
        keep a path with move() and rewind()."""
        if not self.has_tree:
            raise ValueError(f"{self.graph_path} takes no attention_bias: it cannot verify a token tree")
        n_new, past = len(tokens), state.n_past
        depth, ancestors = [0] * n_new, np.zeros((n_new, n_new), dtype=bool)
        for i, parent in enumerate(parents):
            if not -1 <= parent < i:
                raise ValueError(f"token {i}'s parent must come before it, got {parent}")
            if parent >= 0:
                depth[i], ancestors[i] = depth[parent] + 1, ancestors[parent]
            ancestors[i, i] = True
        feeds = {"input_ids": np.asarray([tokens], dtype=np.int64),
                 "position_ids": (past + np.asarray(depth, dtype=np.int64))[None],
                 "logits_from": self._zero}
        width = self._bias_width(state, past + n_new)
        bias = np.zeros((1, 1, n_new, width), dtype=self.bias_dtype)
        bias[0, 0, :, past:past + n_new][~ancestors] = -np.inf
        logits = self._run(state, feeds, n_new, self.session, bias)
        state.n_past += n_new
        return self.fit_width(logits[0])

    def move(self, state: DecoderState, src: int, dst: int) -> None:
        """Copy cached position src to position dst in every KV buffer (a tree's kept path, append_tree)."""
        for buf in state.cache:
            buf[:, :, dst] = buf[:, :, src]

    def _bias_width(self, state: DecoderState, total: int) -> int:
        """The attention_bias's last dimension: the attention's total length, the mask's width (shared layout:
        the buffers' capacity, once ensured for total)."""
        if self.shared:
            state.pool.ensure(total)
            return state.pool.capacity
        return total

    def _run(self, state: DecoderState, feeds: dict[str, np.ndarray], rows: int, session,
             bias: np.ndarray | None = None) -> np.ndarray:
        """One run of feeds' tokens after the state's past, in either layout; bias: the attention_bias (zeros by
        default, where the graph takes one)."""
        total = state.n_past + feeds["input_ids"].shape[1]
        if self.has_tree:
            feeds["attention_bias"] = bias if bias is not None else _zeros(
                (1, 1, feeds["input_ids"].shape[1], self._bias_width(state, total)), self.bias_dtype)
        if self.shared:
            return self._run_shared(state, feeds, rows, session)
        if total > self._ones.shape[1]:
            self._ones = np.ones((1, max(total, 2 * self._ones.shape[1])), dtype=np.int64)
        return self._run_copy(state, feeds | {"attention_mask": self._ones[:, :total]}, session)

    def _session_for(self, n_new: int, wide: bool):
        """The session a run of n_new tokens goes to: the block graph from block_from tokens on, else a wide run's
        prefill session when there is one, else the decoder's own."""
        if self._block is not None and self.block_from is not None and n_new >= self.block_from:
            return self._block
        return self._wide if wide and n_new > 1 and self._wide is not None else self.session

    def choose_block_from(self, ks: tuple[int, ...] = (2, 3, 4, 6, 8, 12, 16), context: int = 64, reps: int = 3,
                          clock=time.perf_counter) -> dict[int, tuple[float, float]]:
        """Time a run of k tokens after `context` cached tokens on each graph (median of reps, the graphs in turn)
        and set block_from: the smallest k from which the block graph is the faster at every k measured (None:
        nowhere). Returns {k: (seconds on the decoder's graph, seconds on the block graph)}."""
        if self._block is None:
            return {}
        state = self.new_state()
        self.block_from = None
        self.append(state, [(3 + i) % self.model_vocab for i in range(context)], last_only=True)
        times: dict[tuple[int, bool], list[float]] = {}
        for _ in range(reps + 1):  # the first round warms both graphs up (not counted)
            for k in ks:
                for on_block in (False, True):
                    self.block_from = 2 if on_block else None
                    started = clock()
                    self.append(state, [5] * k)
                    times.setdefault((k, on_block), []).append(clock() - started)
                    self.rewind(state, context)
        self.block_from = None
        costs = {k: (statistics.median(times[k, False][1:]), statistics.median(times[k, True][1:])) for k in ks}
        for k in reversed(ks):
            if costs[k][1] >= costs[k][0]:
                break
            self.block_from = k
        if state.pool is not None:
            state.pool.release(state)
        return costs

    def _run_copy(self, state: DecoderState, feeds: dict[str, np.ndarray], session) -> np.ndarray:
        past = state.cache or [np.zeros(self.kv_shape, dtype=self.kv_dtype) for _ in self.past_names]
        feeds = {name: value for name, value in feeds.items() if name in self.input_names}
        outs = session.run(["logits", *self.present_names], feeds | dict(zip(self.past_names, past)))
        state.cache = outs[1:]
        return outs[0]

    def _run_shared(self, state: DecoderState, feeds: dict[str, np.ndarray], rows: int, session) -> np.ndarray:
        """rows: the positions the logits come out for (all fed, or the last one)."""
        state.pool.ensure(state.n_past + feeds["input_ids"].shape[1])
        feeds["attention_mask"] = self._mask(state, state.n_past + feeds["input_ids"].shape[1])
        if session is self.session:
            binding = state.binding
            state.step = None  # input_ids and logits are bound to this run's arrays now
        else:  # the prefill session: a binding of its own over the state's buffers, for this run only
            binding = self._kv_binding(session, state.cache)
        logits = self._bind_io(binding, feeds, 1, rows)
        session.run_with_iobinding(binding)
        return logits

    def _bind_io(self, binding, feeds: dict[str, np.ndarray], rows: int, positions: int) -> np.ndarray:
        """Bind those of the feeds that the graph takes (position_ids and logits_from are optional), and the logits
        output [rows, positions, head_width] to a numpy array of ours, returned (no OrtValue, no copy out)."""
        for name, value in feeds.items():
            if name in self.input_names:
                binding.bind_cpu_input(name, value)
        logits = np.empty((rows, positions, self.head_width), dtype=self.logits_dtype)
        binding.bind_output("logits", "cpu", 0, self.logits_dtype, list(logits.shape), logits.ctypes.data)
        return logits

    def _mask(self, state: DecoderState, total: int) -> np.ndarray:
        """The state's attention mask (DecoderState.mask) with ones over exactly the first `total` positions."""
        mask, ones = state.mask, state.mask_ones
        if total > ones:
            mask[0, ones:total] = 1
        elif total < ones:
            mask[0, total:ones] = 0
        state.mask_ones = total
        return mask

    def _step_shared(self, state: DecoderState, token: int, scratch: bool = False) -> np.ndarray:
        """append() of one token, shared layout: every input and the logits stay bound (DecoderState.step and
        .mask), so a step only writes the token, its position and one mask element (binding cost 0.1-0.2 ms of
        Python a step). Returns logits [1, vocab_width]: a copy, or with scratch the bound buffer itself."""
        state.pool.ensure(state.n_past + 1)
        if state.step is None:
            ids, positions = np.zeros((1, 1), dtype=np.int64), np.zeros((1, 1), dtype=np.int64)
            # backed by the arrays' memory: what a later run reads is their value then
            feeds = {"input_ids": ids, "position_ids": positions, "logits_from": self._zero,
                     "attention_mask": state.mask}
            if self.has_tree:  # as wide as the mask: both are rebound when the buffers grow
                feeds["attention_bias"] = _zeros((1, 1, 1, state.mask.shape[1]), self.bias_dtype)
            state.step = (ids, positions, self._bind_io(state.binding, feeds, 1, 1))
        ids, positions, logits = state.step
        ids[0, 0], positions[0, 0] = token, state.n_past
        self._mask(state, state.n_past + 1)
        self.session.run_with_iobinding(state.binding)
        state.n_past += 1
        return self.fit_width(logits[0] if scratch else logits[0].copy())

    def greedy_steps(self, state: DecoderState, token: int, n: int) -> list[int]:
        """n one-token steps, each fed the argmax of the one before (greedy drafting), starting with `token`; the n
        argmax tokens. The same runs as n append() calls, with no Python between them but the step's own (on the demo
        draft a token's Python was a fifth of its run)."""
        out = []
        for _ in range(n):
            logits = self._step_shared(state, token, scratch=True) if self.shared else self.append(state, [token])
            token = int(logits[0].argmax())
            out.append(token)
        return out

    def _alloc(self, rows: int, needed: int, capacity: int) -> list[np.ndarray]:
        """Zeroed buffers [rows, kv_heads, cap, head_dim]: cap doubles `capacity` (up to the context) or is `needed`."""
        cap = max(needed, min(max(2 * capacity, self.initial_capacity), self.context_len))
        return [np.zeros((rows, self.kv_shape[1], cap, self.kv_shape[3]), dtype=self.kv_dtype) for _ in self.past_names]

    def _kv_binding(self, session, buffers: list[np.ndarray]):
        """A new IO binding of session with each buffer bound as both a past input and its present output (the
        kernel writes into it)."""
        binding = session.io_binding()
        for past, present, buf in zip(self.past_names, self.present_names, buffers):
            value = ort.OrtValue.ortvalue_from_numpy(buf)  # shares buf's memory
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        return binding

    def new_pool(self, slots: int) -> KvPool:
        """Batched buffers for up to `slots` sequences (shared layout only): see KvPool."""
        if not self.shared:
            raise ValueError("a KV pool needs the shared-buffer layout (a builder export on the CPU provider)")
        return KvPool(self, slots)

    def append_batch(self, states: list[DecoderState], tokens: list[int]) -> np.ndarray:
        """One token after each state's past, all states slots of one KvPool, in ONE run; logits [B, vocab].
        GroupQueryAttention batches rows with different pasts only for one new token per row, so blocks of several
        tokens run one sequence at a time (`append`). The run covers the states' slots start..stop; a slot in that
        range not in the batch gets a dummy token at its n_past, past what it caches (its next append overwrites it)."""
        pool = states[0].pool
        if pool is None or any(s.pool is not pool for s in states):
            raise ValueError("append_batch needs states from one KvPool")
        start, stop = min(s.slot for s in states), max(s.slot for s in states) + 1
        rows = [s.slot - start for s in states]
        past = [pool.n_past(slot) for slot in range(start, stop)]
        pool.ensure(max(past) + 1)
        ids = np.zeros((stop - start, 1), dtype=np.int64)
        ids[rows, 0] = tokens
        mask = (np.arange(max(past) + 1)[None] <= np.asarray(past)[:, None]).astype(np.int64)
        binding = pool.binding(start, stop)
        feeds = {"input_ids": ids, "attention_mask": mask, "position_ids": np.asarray(past, dtype=np.int64)[:, None],
                 "logits_from": self._zero}
        if self.has_tree:
            feeds["attention_bias"] = _zeros((1, 1, 1, mask.shape[1]), self.bias_dtype)
        logits = self._bind_io(binding, feeds, stop - start, 1)
        self.session.run_with_iobinding(binding)
        for state in states:
            state.n_past += 1
        return self.fit_width(logits[rows, 0])

    def rewind(self, state: DecoderState, n_keep: int) -> None:
        """Keep only the first n_keep cached positions."""
        if n_keep > state.n_past:
            raise ValueError(f"cannot roll back to {n_keep} tokens; cache holds {state.n_past}")
        if n_keep < state.n_past and not self.shared:
            state.cache = [past[:, :, :n_keep, :] for past in state.cache]
        state.n_past = n_keep

    def fit_width(self, logits: np.ndarray) -> np.ndarray:
        """Make the logits as wide as vocab_width (-inf where the model has no column, or its head no row)."""
        if self.head_tokens is None and logits.shape[-1] >= self.vocab_width:
            return logits[..., :self.vocab_width]  # a view: no copy
        out = np.full((*logits.shape[:-1], self.vocab_width), -np.inf, dtype=logits.dtype)
        out[..., self._head_cols] = logits[..., self._head_in]
        return out


@functools.lru_cache(maxsize=16)
def _zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A read-only array of zeros (an attention_bias that masks nothing), made once per shape."""
    out = np.zeros(shape, dtype=dtype)
    out.flags.writeable = False
    return out


class KvPool:
    """Shared-layout KV buffers for several sequences, [slots, kv_heads, capacity, head_dim] per past tensor, so
    that one-token steps of many sequences run as one batch (`OnnxDecoder.append_batch`) with no copy. A slot's
    state binds the views buf[slot:slot + 1] and runs alone like any shared-layout state (blocks of several
    tokens). The capacity doubles for all slots when one needs more, up to the context. A state's own buffers are
    a pool of one slot (OnnxDecoder.new_state)."""

    def __init__(self, decoder: OnnxDecoder, slots: int):
        self.decoder, self.slots = decoder, slots
        self.cache: list[np.ndarray] = []
        # weak: a state dropped without release() (a probe, a crashed request) frees its slot when collected
        self._states: weakref.WeakValueDictionary[int, DecoderState] = weakref.WeakValueDictionary()
        self._bindings: dict[tuple[int, int], Any] = {}  # (start, stop) -> IO binding of those slots' buffers

    @property
    def capacity(self) -> int:
        return self.cache[0].shape[2] if self.cache else 0

    def n_past(self, slot: int) -> int:
        return getattr(self._states.get(slot), "n_past", 0)  # a free slot caches nothing

    def acquire(self) -> DecoderState | None:
        """A fresh state in a free slot (None: every slot is taken)."""
        free = next((i for i in range(self.slots) if i not in self._states), None)
        if free is None:
            return None
        state = self._states[free] = DecoderState(pool=self, slot=free)
        if self.cache:  # else the first run's ensure() allocates the buffers and binds every slot
            self._bind(state)
        return state

    def release(self, state: DecoderState) -> None:
        if self._states.get(state.slot) is state:
            del self._states[state.slot]
        state.pool, state.binding, state.cache, state.n_past, state.step = None, None, [], 0, None
        state.mask, state.mask_ones = None, 0

    def ensure(self, needed: int) -> None:
        """At least `needed` positions per slot; growing copies every slot's cached positions once."""
        if needed <= self.capacity:
            return
        buffers = self.decoder._alloc(self.slots, needed, self.capacity)
        for new, old in zip(buffers, self.cache):
            new[:, :, :old.shape[2]] = old
        self.cache = buffers
        self._bindings.clear()
        for state in self._states.values():
            self._bind(state)

    def binding(self, start: int, stop: int):
        """An IO binding with slots start..stop of every past buffer bound as both past and present (made once per
        range and capacity: binding 2 x layers OrtValues costs more than the inputs)."""
        if (start, stop) not in self._bindings:
            views = [buf[start:stop] for buf in self.cache]
            self._bindings[(start, stop)] = self.decoder._kv_binding(self.decoder.session, views)
        return self._bindings[(start, stop)]

    def _bind(self, state: DecoderState) -> None:
        views = [buf[state.slot:state.slot + 1] for buf in self.cache]
        state.cache, state.binding, state.step = views, self.decoder._kv_binding(self.decoder.session, views), None
        state.mask, state.mask_ones = np.zeros((1, self.capacity), dtype=np.int64), 0
