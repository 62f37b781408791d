"""Engine configuration: what a user sets (the model, memory, batching limits) with vLLM's names.

`EngineConfig` is the one definition: the command-line flags that set it (`add_engine_args`, read back
by `engine_config_kwargs`) take their types and defaults from its fields, so the two cannot drift.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, get_args, get_origin, get_type_hints

GiB = 1 << 30
QUANTIZATION_CHOICES = ("int8", "fp8")  # as llmserve.model.quantization.QUANTIZATION_METHODS (torch-free here)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
TASKS = ("auto", "generate", "embed", "classify")
DEFAULT_STEP_TOKENS = 1024  # max_num_batched_tokens unless configured (see EngineConfig)
ENCODER_STEP_TOKENS = 8192
POOLING_TYPES = ("mean", "cls", "last")  # how llmserve.model.pooling pools a sequence


@dataclass
class EngineConfig:
    model: str
    tokenizer: str | None = None  # defaults to the model directory
    # a Jinja chat template, or a file holding one, in place of the tokenizer's (vLLM's --chat-template)
    chat_template: str | None = None
    revision: str | None = None
    dtype: str = "auto"  # auto: the checkpoint's dtype on CPU; bfloat16 on CUDA unless the checkpoint is float16
    device: str = "auto"  # auto: cuda when available, else cpu
    seed: int = 0
    load_format: str = "auto"  # auto | dummy (random weights from the config, no checkpoint read)
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int = 4 * GiB  # bytes for the KV pool (CPU; on CUDA see gpu_memory_utilization)
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    gpu_memory_utilization: float = 0.9
    # tokens one engine step computes at most; None: 1024, or for an encoder (each sequence computed whole in one
    # step, nothing cached) 8192 and at least its context (llmserve.engine.model_facts.step_token_budget)
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True  # share full KV blocks by content across requests
    # Overlapped scheduling: while step N runs on the device, the engine core schedules and prepares
    # step N+1; sampled token ids stay on the device. False runs the steps one after another.
    async_scheduling: bool = True
    attention_backend: str | None = None  # None: the best for the device ("triton" on CUDA, else "torch")
    enforce_eager: bool = False  # never use CUDA graphs (they are only used on CUDA anyway)
    cuda_graph_sizes: list[int] | None = None  # decode batch sizes to capture; None: 1, 2, 4, 8, 16, 32, ...
    served_model_name: str | None = None
    # int8 | fp8: quantize the linear layers' weights at load (a checkpoint with a quantization_config
    # runs quantized without it); see llmserve.model.quantization.
    quantization: str | None = None
    # with `quantization` applied at load: the lm_head too (as llama.cpp's Q8_0 does; vLLM leaves it). It is
    # a large share of a small model's weights and of each decode step's bytes (6.5% on Llama-3.1-8B in fp8).
    quantize_lm_head: bool = False
    # auto: the model dtype; fp8 (fp8_e4m3): e4m3 with a per-tensor scale (triton backend); int8: int8 with a
    # scale per token and kv head (torch backend, CPU)
    kv_cache_dtype: str = "auto"
    # embed: serve embeddings (/v1/embeddings, LLM.embed); a decoder model still generates too.
    # auto: embed for an encoder (BERT) or a checkpoint in the sentence-transformers layout.
    task: str = "auto"
    pooling: str | None = None  # mean | cls | last; None: the sentence-transformers layout's, else last (cls: encoders)
    # merged over config.json (vLLM's --hf-overrides): e.g. a Qwen3-Reranker served as the classifier it is
    # scored as, {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"]}
    hf_overrides: dict[str, Any] | None = None
    # vLLM's --limit-mm-per-prompt: {"image": N}, the most images one prompt of a vision-language model holds
    limit_mm_per_prompt: dict[str, Any] | None = None
    normalize: bool = True  # False: never L2-normalise embeddings (else as the layout says; no layout: yes)
    # LoRA adapters (PEFT's layout), each served under its own name: "NAME=PATH", or vLLM's JSON form
    # {"name": ..., "path": ..., "base_model_name": ...}. Any implies enable_lora.
    lora_modules: list[str] | None = None
    enable_lora: bool = False  # serve LoRA adapters: those of lora_modules, and more loaded at run time
    max_loras: int = 1  # adapters one engine step may use (the slots each adapted layer holds)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept read on the host; None: max_loras
    # Speculative decoding (vLLM's --speculative-config): {"method": "ngram", "num_speculative_tokens": k,
    # "prompt_lookup_max": n, "prompt_lookup_min": m}; see SpeculativeConfig. Steps then run one after another.
    speculative_config: dict[str, Any] | None = None
    # Megatron-style tensor parallelism (vLLM's --tensor-parallel-size): every layer's heads and MLP features split
    # over this many processes (torch.distributed: gloo on CPU, NCCL on CUDA), one device each
    tensor_parallel_size: int = 1
    # CPU: the threads each engine core (each tensor-parallel rank) computes with; None: the machine's cores, shared
    # among the ranks. One thread serves a small encoder's single texts sooner (a router's embeddings).
    cpu_threads: int | None = None
    # Prefill/decode disaggregation: this engine keeps the prompt KV of requests sent with kv_transfer_params
    # {"do_remote_decode": true} for another engine to pull, and pulls the KV of those sent with
    # {"do_remote_prefill": true, ...} from the engine named; over a ZeroMQ port of its own (0: any free port)
    kv_transfer: bool = False
    kv_transfer_host: str = "0.0.0.0"
    kv_transfer_port: int = 0
    kv_transfer_ttl: float = 30.0  # seconds held KV waits for its pull before it is let go
    # The prefix cache's second tier: full KV blocks evicted from the pool are kept, up to this many GiB, in host
    # memory, or with kv_offload_dir in files there (kept across restarts), and loaded back instead of recomputed
    kv_offload_gib: float = 0.0
    kv_offload_dir: str | None = None

    @property
    def lora_enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return parse_speculative_config(self.speculative_config)

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1.")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1.")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1].")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, got {self.quantization!r}.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}.")
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}.")
        if self.pooling is not None and self.pooling not in POOLING_TYPES:
            raise ValueError(f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.pooling!r}.")
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise ValueError(f"hf_overrides must be a JSON object, got {self.hf_overrides!r}.")
        limit = self.limit_mm_per_prompt
        if limit is not None and (not isinstance(limit, dict) or set(limit) - {"image"} or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in limit.values())):
            raise ValueError(f'limit_mm_per_prompt must be {{"image": N}} with N >= 0, got {limit!r}.')
        if self.cuda_graph_sizes is not None and any(size < 1 for size in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be positive, got {self.cuda_graph_sizes}.")
        for name in ("max_loras", "max_lora_rank", "max_cpu_loras"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        parse_lora_modules(self.lora_modules or [])
        parse_speculative_config(self.speculative_config)
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}.")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be at least 1, got {self.cpu_threads}.")
        if self.kv_transfer:
            self._validate_kv_transfer()
        if self.kv_offload_gib < 0:
            raise ValueError(f"kv_offload_gib must be >= 0, got {self.kv_offload_gib}.")
        if self.kv_offload_gib or self.kv_offload_dir:
            self._validate_kv_offload()

    def _validate_kv_offload(self) -> None:
        if not self.kv_offload_gib:
            raise ValueError("kv_offload_dir needs kv_offload_gib: how much of it the KV may take.")
        if not self.enable_prefix_caching:
            raise ValueError("kv_offload needs prefix caching: the second tier keeps the prefix cache's blocks.")

    def _validate_kv_transfer(self) -> None:
        if not self.enable_prefix_caching:
            raise ValueError("kv_transfer needs prefix caching: pulled KV joins the prefix cache.")
        if not 0 <= self.kv_transfer_port <= 65535:
            raise ValueError(f"kv_transfer_port must be a TCP port (0: any free one), got {self.kv_transfer_port}.")
        if self.kv_transfer_ttl <= 0:
            raise ValueError(f"kv_transfer_ttl must be positive, got {self.kv_transfer_ttl}.")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: each decoding sequence's next tokens are guessed (drafted) and verified in the next
    step with it. `ngram` (vLLM's, "prompt lookup decoding"): its last `prompt_lookup_max` down to
    `prompt_lookup_min` tokens are looked up earlier in its own tokens, and the `num_speculative_tokens` tokens
    that followed there are the draft. `draft_model` (vLLM's): a smaller model of the same vocabulary, `model`,
    decodes `num_speculative_tokens` tokens greedily ahead of the served one."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 0
    prompt_lookup_max: int = 0
    method: str = "ngram"
    disable_by_batch_size: int | None = None  # no drafts while this many sequences or more are running
    model: str | None = None  # the draft model (a local directory or a hub id), for `draft_model`


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size", "draft_tensor_parallel_size")
_NGRAM_MODEL_NAMES = (None, "ngram", "[ngram]")  # vLLM's older way to ask for n-grams: as the "model"
_NGRAM_ONLY_KEYS = ("prompt_lookup_min", "prompt_lookup_max")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given


def parse_speculative_config(spec: dict[str, Any] | None) -> SpeculativeConfig | None:
    """`--speculative-config` in vLLM's form; a ValueError names what is wrong or unsupported."""
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config: must be a JSON object, got {spec!r}.")
    unknown = sorted(set(spec) - set(_SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: {', '.join(unknown)} not supported; it takes {', '.join(_SPECULATIVE_KEYS)}.")
    model = spec.get("model")
    method = spec.get("method", "ngram" if model in _NGRAM_MODEL_NAMES else "draft_model")
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config: method {method!r} is not supported; llmserve speculates with "
            f"{' or '.join(SPECULATIVE_METHODS)} (EAGLE, Medusa and MTP heads are not served)."
        )
    count = spec.get("num_speculative_tokens")
    disable = spec.get("disable_by_batch_size")
    extra = {"disable_by_batch_size": disable} if disable is not None else {}  # null, as unset: every batch size
    _check_positive({"num_speculative_tokens": count, **extra})
    if method == "draft_model":
        return _draft_model_config(spec, model, count, extra)
    if model not in _NGRAM_MODEL_NAMES:
        raise ValueError(f"speculative_config: the ngram method takes no model, got {model!r}.")
    if "draft_tensor_parallel_size" in spec:
        raise ValueError("speculative_config: draft_tensor_parallel_size belongs to the draft_model method, not ngram.")
    lookup_min, lookup_max = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if lookup_min is None and lookup_max is None:
        lookup_min = lookup_max = DEFAULT_PROMPT_LOOKUP
    lookup_min = lookup_max if lookup_min is None else lookup_min
    lookup_max = lookup_min if lookup_max is None else lookup_max
    _check_positive({"prompt_lookup_min": lookup_min, "prompt_lookup_max": lookup_max})
    if lookup_min > lookup_max:
        raise ValueError(f"speculative_config: prompt_lookup_min ({lookup_min}) exceeds prompt_lookup_max ({lookup_max}).")
    return SpeculativeConfig(count, lookup_min, lookup_max, method, **extra)


def _draft_model_config(spec: dict[str, Any], model: Any, count: int, extra: dict[str, Any]) -> SpeculativeConfig:
    if not isinstance(model, str) or not model or model in _NGRAM_MODEL_NAMES:
        raise ValueError("speculative_config: the draft_model method needs \"model\": the draft model's path or hub id.")
    ngram_keys = [key for key in _NGRAM_ONLY_KEYS if key in spec]
    if ngram_keys:
        raise ValueError(f"speculative_config: {', '.join(ngram_keys)} belong to the ngram method, not draft_model.")
    if spec.get("draft_tensor_parallel_size", 1) != 1:
        raise ValueError("speculative_config: draft_tensor_parallel_size must be 1: the draft model runs whole, on "
                         "rank 0 under tensor parallelism.")
    return SpeculativeConfig(count, method="draft_model", model=model, **extra)


def _check_positive(values: dict[str, Any]) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"speculative_config: {name} must be a positive integer, got {value!r}.")


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str


def parse_lora_modules(specs: list[str]) -> list[LoRAModule]:
    """`--lora-modules` entries: "NAME=PATH" or a JSON object with "name" and "path" (vLLM's forms)."""
    modules = []
    for spec in specs:
        if spec.lstrip().startswith("{"):
            try:
                entry = json.loads(spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"lora_modules: {spec!r} is not JSON: {exc}") from None
            name, path = entry.get("name"), entry.get("path")
        else:
            name, _, path = spec.partition("=")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: {spec!r} must be NAME=PATH or {{\"name\": ..., \"path\": ...}}.")
        modules.append(LoRAModule(name, path))
    names = [module.name for module in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"lora_modules: two adapters are named alike in {names}.")
    return modules


# ---- the command-line flags that set EngineConfig ----


@dataclass(frozen=True)
class _EngineFlag:
    """A flag that sets one EngineConfig field; its type and default come from the field.

    A bool field's flag is a switch: `store_true` when the field defaults to False, `store_false`
    (a `--no-...` flag) when it defaults to True.
    """

    field: str
    flag: str
    help: str | None = None
    choices: tuple[str, ...] | None = None
    in_gib: bool = False  # the flag takes GiB, the field holds bytes

    @property
    def dest(self) -> str:
        return f"{self.field}_gib" if self.in_gib else self.field


_ENGINE_FLAGS: tuple[_EngineFlag, ...] = (
    _EngineFlag("tokenizer", "--tokenizer", help="a directory with the tokenizer to use (default: the model's)"),
    _EngineFlag(
        "chat_template", "--chat-template",
        help="a Jinja chat template, or a file holding one, used in place of the tokenizer's (for a model without "
        "one, or to change it)",
    ),
    _EngineFlag("dtype", "--dtype", choices=("auto", "float32", "bfloat16", "float16")),
    _EngineFlag("device", "--device"),
    _EngineFlag("max_model_len", "--max-model-len"),
    _EngineFlag("max_num_batched_tokens", "--max-num-batched-tokens",
                help="tokens one engine step computes at most (default: 1024; an encoder's: 8192, at least its context)"),
    _EngineFlag("max_num_seqs", "--max-num-seqs"),
    _EngineFlag("block_size", "--block-size"),
    _EngineFlag("kv_cache_memory", "--kv-cache-memory-gib", in_gib=True),
    _EngineFlag("num_kv_blocks", "--num-kv-blocks"),
    _EngineFlag(
        "scheduling_policy", "--scheduling-policy", choices=("fcfs", "priority"),
        help="priority: the request's priority field orders admission and preemption (lower first)",
    ),
    _EngineFlag(
        "enable_prefix_caching", "--no-prefix-caching",
        help="turn off the reuse of cached KV blocks across requests with the same prefix",
    ),
    _EngineFlag(
        "load_format", "--load-format", choices=("auto", "dummy"),
        help="dummy: random weights from config.json, no checkpoint read",
    ),
    _EngineFlag("seed", "--seed"),
    _EngineFlag(
        "quantization", "--quantization", choices=QUANTIZATION_CHOICES,
        help="quantize the linear layers' weights at load: int8 (per-channel, weight-only; CPU and GPU) or fp8 "
        "(e4m3 per-channel; fp8 matmul on GPUs of compute capability 8.9+). Checkpoints with a "
        "quantization_config run quantized without it",
    ),
    _EngineFlag(
        "quantize_lm_head", "--quantize-lm-head",
        help="with --quantization: quantize the lm_head too (fewer bytes a decode step, a little more error: "
        "see BENCHMARKS.md); not for tied embeddings or checkpoints already quantized",
    ),
    _EngineFlag(
        "kv_cache_dtype", "--kv-cache-dtype", choices=KV_CACHE_DTYPES,
        help="fp8: store the KV cache in e4m3 with a per-tensor scale (twice the tokens per byte; triton attention "
        "backend, GPU); int8: int8 with a scale per token and head (1.94x the tokens at head_dim 64; torch "
        "backend, CPU)",
    ),
    _EngineFlag(
        "gpu_memory_utilization", "--gpu-memory-utilization",
        help="CUDA: fraction of device memory for weights, activations and the KV cache",
    ),
    _EngineFlag("enforce_eager", "--enforce-eager", help="CUDA: never use CUDA graphs"),
    _EngineFlag("attention_backend", "--attention-backend", help="default: triton on CUDA, torch elsewhere"),
    _EngineFlag(
        "task", "--task", choices=TASKS,
        help="embed: also serve /v1/embeddings (auto: for encoders and sentence-transformers checkpoints); "
        "classify: a sequence-classification model's labels and scores (auto for one)",
    ),
    _EngineFlag("pooling", "--pooling", choices=POOLING_TYPES, help="embeddings: how token states are pooled"),
    _EngineFlag("normalize", "--no-normalize", help="embeddings: never L2-normalise them"),
    _EngineFlag("hf_overrides", "--hf-overrides", help="a JSON object merged over the model's config.json"),
    _EngineFlag(
        "limit_mm_per_prompt", "--limit-mm-per-prompt",
        help='{"image": N}: the most images a prompt of a vision-language model holds (default 16; 0: none)',
    ),
    _EngineFlag(
        "lora_modules", "--lora-modules",
        help="LoRA adapters (PEFT's layout) served under their own names: NAME=PATH or a JSON object "
        '{"name": ..., "path": ...}, several at once (implies --enable-lora)',
    ),
    _EngineFlag(
        "enable_lora", "--enable-lora",
        help="serve LoRA adapters: those of --lora-modules, and more loaded at run time (/v1/load_lora_adapter)",
    ),
    _EngineFlag("max_loras", "--max-loras", help="LoRA adapters one engine step may use (default 1)"),
    _EngineFlag("max_lora_rank", "--max-lora-rank", help="the highest LoRA rank served (default 16)"),
    _EngineFlag("max_cpu_loras", "--max-cpu-loras", help="LoRA adapters kept read in host memory (default: --max-loras)"),
    _EngineFlag(
        "speculative_config", "--speculative-config",
        help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2} proposes the tokens that followed the sequence\'s last '
        "n-gram earlier in its own text, verified in one step (steps then run one after another)",
    ),
    _EngineFlag(
        "tensor_parallel_size", "--tensor-parallel-size",
        help="split every layer over this many processes (one device each; gloo on CPU, NCCL on CUDA): for a "
        "model too big for one device, or decode bound by one device's memory bandwidth",
    ),
    _EngineFlag(
        "cpu_threads", "--cpu-threads",
        help="CPU: threads each engine core computes with (default: the machine's cores, shared among tensor-parallel "
        "ranks); 1 serves a small encoder's single texts sooner",
    ),
    _EngineFlag(
        "kv_transfer", "--kv-transfer",
        help="prefill/decode disaggregation: keep the prompt KV of requests with kv_transfer_params "
        '{"do_remote_decode": true} for another replica to pull, and pull it for requests with '
        '{"do_remote_prefill": true, ...} (the gateway\'s --prefill-pool sends both)',
    ),
    _EngineFlag("kv_transfer_host", "--kv-transfer-host", help="the address the KV side channel listens on (default 0.0.0.0)"),
    _EngineFlag("kv_transfer_port", "--kv-transfer-port", help="the KV side channel's TCP port (default 0: any free one)"),
    _EngineFlag("kv_transfer_ttl", "--kv-transfer-ttl", help="seconds held KV waits for its pull (default 30)"),
    _EngineFlag(
        "kv_offload_gib", "--kv-offload-gib",
        help="a second tier for the prefix cache: KV blocks evicted from the pool are kept, up to this many GiB, "
        "in host memory (or in --kv-offload-dir) and loaded back when a prompt starts with them (default 0: none)",
    ),
    _EngineFlag(
        "kv_offload_dir", "--kv-offload-dir",
        help="keep the second tier's blocks in files in this directory (an SSD), kept across restarts",
    ),
    _EngineFlag(
        "async_scheduling", "--no-async-scheduling",
        help="run engine steps one after another instead of overlapping the next step's scheduling "
        "with the current one (for comparison)",
    ),
)


def _argparse_options(flag: _EngineFlag, field: dataclasses.Field, hint: Any) -> dict[str, Any]:
    default = field.default
    if default is dataclasses.MISSING:
        raise TypeError(f"EngineConfig.{field.name} has no default, so it cannot be a flag.")
    options: dict[str, Any] = {"dest": flag.dest, "help": flag.help}
    if hint is bool:
        if flag.flag.startswith("--no-") is not default:  # --no-x turns off what is on by default
            raise TypeError(f"{flag.flag}: the switch's name does not fit the default {default}.")
        return {**options, "action": "store_false" if default else "store_true", "default": default}
    types = [arg for arg in get_args(hint) if arg is not type(None)] or [hint]
    if len(types) != 1:
        raise TypeError(f"EngineConfig.{field.name}: no single flag type in {hint}.")
    if flag.in_gib:
        return {**options, "type": float, "default": default / GiB}
    kind = get_origin(types[0]) or types[0]
    if kind is list:  # several values after the flag
        (item,) = get_args(types[0])
        return {**options, "nargs": "+", "type": None if item is str else item, "default": default}
    flag_type = {str: None, dict: _json_object}.get(kind, kind)  # argparse's strings need no conversion
    return {**options, "type": flag_type, "default": default, "choices": flag.choices}


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_engine_args(parser: argparse.ArgumentParser, several_models: bool = False) -> None:
    """Add `--model` and a flag for each EngineConfig field a user sets from the command line.

    `several_models`: `--model` may be repeated, each optionally named (`NAME=MODEL`), as `serve` takes.
    """
    if several_models:
        parser.add_argument(
            "--model", action="append", default=None, metavar="[NAME=]MODEL",
            help="checkpoint directory or hub id, optionally named; repeat to serve several (default: built-in)",
        )
    else:
        parser.add_argument("--model", default=None, help="checkpoint directory or hub id (default: built-in model)")
    fields = {field.name: field for field in dataclasses.fields(EngineConfig)}
    hints = get_type_hints(EngineConfig)
    for flag in _ENGINE_FLAGS:
        parser.add_argument(flag.flag, **_argparse_options(flag, fields[flag.field], hints[flag.field]))


def engine_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The EngineConfig keyword arguments the flags of `add_engine_args` give (all but the model)."""
    kwargs: dict[str, Any] = {}
    for flag in _ENGINE_FLAGS:
        value = getattr(args, flag.dest)
        kwargs[flag.field] = int(value * GiB) if flag.in_gib else value
    return kwargs
