"""The model zoo's catalog: which models `torch-pjrt zoo` runs, and how each is built on CPU.

Hugging Face architectures come from transformers' auto mappings (one per task), each built from its
config class's defaults shrunk to a small size, with random weights: nothing is downloaded. A user's
own models come from factories: a callable taking no arguments and returning `(model, inputs)`,
where inputs is a dict of keyword arguments (or a tuple of positional ones) for `model(...)`.
timm's image models (`--library timm`): the model with the fewest parameters of each of timm's model
modules, built by `timm.create_model` with random weights and fed random images.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

BATCH = 2
SEQUENCE = 8
IMAGE = 32
VOCAB = 96
LABELS = 3
FIRST_ORDINARY_TOKEN = 4  # ids below are left to special tokens (pad, bos, eos, unk)

# Attribute name -> the small value a shrunk config takes (only ever lowered, never raised).
SMALL_SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "embedding_dim", "model_dim",
                     "word_embed_proj_dim", "projection_dim", "text_embed_dim", "vision_embed_dim"), 32),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "d_ff", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim",
                     "hidden_dim", "mlp_dim", "ffn_hidden_size", "inner_hidden_size", "dim_feedforward",
                     "intermediate_dim", "d_inner"), 64),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers",
                     "decoder_layers", "num_decoder_layers", "num_encoder_layers", "n_layers_encoder",
                     "n_layers_decoder"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "n_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "attention_head_size", "d_head", "kv_channels"), 8),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), 8),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts"), 2),
    **dict.fromkeys(("vocab_size", "n_vocab", "text_vocab_size"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                     "seq_length", "context_length", "max_length", "block_size"), 64),
    **dict.fromkeys(("image_size", "img_size"), IMAGE),
    "patch_size": 8,
    **dict.fromkeys(("sliding_window", "attention_window", "window_size"), 64),
    **dict.fromkeys(("embedding_size", "num_channels_hidden"), 16),
    "rotary_dim": 8,
    "mamba_n_heads": 4, "mamba_d_head": 16, **dict.fromkeys(("mamba_d_state", "state_size", "d_state"), 16),
}
# Sizes equal to another by default stay equal to it when shrunk (models assume it: key-value heads,
# ALBERT-style embedding sizes).
KEPT_EQUAL = {"num_key_value_heads": "num_attention_heads", "n_kv_heads": "n_heads",
              "num_kv_heads": "num_attention_heads", "embedding_size": "hidden_size"}
# Per-stage lists of staged (vision) models: widths start at this and double each stage, counts are capped.
STAGE_WIDTHS: dict[str, int] = {"hidden_sizes": 16, "embed_dims": 16, "dims": 16, "encoder_hidden_sizes": 16}
STAGE_COUNTS: dict[str, int] = {"depths": 1, "block_depths": 1, "num_heads": 2}
LAYER_COUNT_NAMES = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
# Dropout and stochastic-depth probabilities are set to 0 so CPU and pjrt draw nothing.
ZERO_PROBABILITY = re.compile(r"(dropout|drop_path|layerdrop|drop_rate|_pdrop)")
TOKEN_ID_NAMES = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "unk_token_id",
                  "sep_token_id", "cls_token_id", "mask_token_id")
NEEDS_EXTERNAL = (("use_timm_backbone", "a timm backbone"), ("use_pretrained_backbone", "pretrained backbone weights"))


class Skip(Exception):
    """This model cannot be run by the zoo (not a pjrt failure): the message says why."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One model the zoo runs: a Hugging Face architecture for a task, or a user factory (`factory` set)."""

    key: str
    family: str
    task: str
    model_class: str = ""
    factory: str = ""
    library: str = "transformers"


def _text_config(config: Any) -> Any:
    """The config that holds the vocabulary (the text sub-config of a composite model)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _token_inputs(config: Any) -> dict[str, torch.Tensor]:
    """Random ordinary tokens; each sequence ends with the end-of-sequence token where the config has one
    (encoder-decoder classifiers pool at it)."""
    text = _text_config(config)
    vocab = int(getattr(text, "vocab_size", VOCAB) or VOCAB)
    ids = torch.randint(FIRST_ORDINARY_TOKEN, vocab, (BATCH, SEQUENCE))
    eos = getattr(text, "eos_token_id", None)
    if isinstance(eos, int) and 0 <= eos < vocab:
        ids[:, -1] = eos
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def causal_lm_inputs(config: Any) -> dict[str, torch.Tensor]:
    inputs = _token_inputs(config)
    return {**inputs, "labels": inputs["input_ids"].clone()}


def sequence_classification_inputs(config: Any) -> dict[str, torch.Tensor]:
    return {**_token_inputs(config), "labels": torch.randint(0, LABELS, (BATCH,))}


def token_classification_inputs(config: Any) -> dict[str, torch.Tensor]:
    return {**_token_inputs(config), "labels": torch.randint(0, LABELS, (BATCH, SEQUENCE))}


def question_answering_inputs(config: Any) -> dict[str, torch.Tensor]:
    return {**_token_inputs(config), "start_positions": torch.randint(0, SEQUENCE, (BATCH,)),
            "end_positions": torch.randint(0, SEQUENCE, (BATCH,))}


def seq2seq_inputs(config: Any) -> dict[str, torch.Tensor]:
    inputs = _token_inputs(config)
    labels = torch.randint(FIRST_ORDINARY_TOKEN, inputs["input_ids"].max().item() + 1, (BATCH, SEQUENCE // 2))
    return {**inputs, "labels": labels}


def _pixels(config: Any) -> torch.Tensor:
    channels = int(getattr(config, "num_channels", 3) or 3)
    return torch.randn(BATCH, channels, IMAGE, IMAGE)


def image_classification_inputs(config: Any) -> dict[str, torch.Tensor]:
    return {"pixel_values": _pixels(config), "labels": torch.randint(0, LABELS, (BATCH,))}


def base_model_inputs(config: Any) -> dict[str, torch.Tensor]:
    """A base model gets tokens, or pixels where its config describes images."""
    if hasattr(config, "image_size") and not hasattr(config, "vocab_size"):
        return {"pixel_values": _pixels(config)}
    inputs = _token_inputs(config)
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = inputs["input_ids"][:, : SEQUENCE // 2].clone()
    return inputs


@dataclasses.dataclass(frozen=True)
class Task:
    """A task's auto mapping in transformers and how its inputs are synthesised."""

    mapping: str
    inputs: Callable[[Any], dict[str, torch.Tensor]]


TASKS: dict[str, Task] = {
    # the order of a run: text generation first, then the other heads, the bare models last
    "causal-lm": Task("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", causal_lm_inputs),
    "masked-lm": Task("MODEL_FOR_MASKED_LM_MAPPING_NAMES", causal_lm_inputs),
    "seq2seq-lm": Task("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", seq2seq_inputs),
    "sequence-classification": Task("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                                    sequence_classification_inputs),
    "image-classification": Task("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", image_classification_inputs),
    "token-classification": Task("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", token_classification_inputs),
    "question-answering": Task("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", question_answering_inputs),
    "base": Task("MODEL_MAPPING_NAMES", base_model_inputs),
}


def hf_cases(tasks: Iterable[str] | None = None) -> list[Case]:
    """Every (architecture, task) pair in transformers' auto mappings, tasks in TASKS' order."""
    from transformers.models.auto import modeling_auto

    cases = []
    for task in tasks or TASKS:
        mapping = getattr(modeling_auto, TASKS[task].mapping)
        for family, classes in sorted(mapping.items()):
            for name in (classes,) if isinstance(classes, str) else classes:
                cases.append(Case(f"{family}/{task}", family, task, model_class=name))
    return cases


# --- shrinking a config ---------------------------------------------------------------------------


def _is_sub_config(value: Any) -> bool:
    return isinstance(value, dict) and "model_type" in value


def _shrunk_value(name: str, value: Any, layers: int | None) -> Any:
    """The small value of one attribute, or `value` itself when it is small already or not a size."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and name in SMALL_SIZES:
        return min(value, SMALL_SIZES[name])
    if isinstance(value, float) and ZERO_PROBABILITY.search(name):
        return 0.0
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        if name in STAGE_WIDTHS:
            return type(value)(min(v, STAGE_WIDTHS[name] * 2**stage) for stage, v in enumerate(value))
        if name in STAGE_COUNTS:
            return type(value)(min(v, STAGE_COUNTS[name]) for v in value)
    if isinstance(value, (list, tuple)) and layers and len(value) == layers and layers > SMALL_SIZES["n_layer"]:
        return type(value)(value[: SMALL_SIZES["n_layer"]])
    return value


def shrunk_overrides(defaults: dict[str, Any]) -> dict[str, Any]:
    """The constructor arguments that make a config (given as its `to_dict()`) small; sub-configs recurse."""
    layers = next((defaults[n] for n in LAYER_COUNT_NAMES if isinstance(defaults.get(n), int)), None)
    overrides: dict[str, Any] = {}
    for name, value in defaults.items():
        if _is_sub_config(value):
            sub = shrunk_overrides(value)
            if sub:
                overrides[name] = {"model_type": value["model_type"], **sub} if value["model_type"] else sub
            continue
        small = _shrunk_value(name, value, layers)
        if small != value:
            overrides[name] = small
    for follower, leader in KEPT_EQUAL.items():
        if follower in overrides and defaults[follower] == defaults.get(leader):
            overrides[follower] = overrides.get(leader, defaults[leader])
    vocab = overrides.get("vocab_size", defaults.get("vocab_size"))
    if isinstance(vocab, int):
        for name in TOKEN_ID_NAMES:
            token = defaults.get(name)
            if isinstance(token, int) and token >= vocab:
                overrides[name] = min(TOKEN_ID_NAMES.index(name), FIRST_ORDINARY_TOKEN - 1)
            elif isinstance(token, list) and any(isinstance(t, int) and t >= vocab for t in token):
                overrides[name] = [2]
    return overrides


def small_config(config_class: type, task: str) -> Any:
    """The config class's defaults, shrunk; raises Skip when it needs files or packages not here."""
    try:
        defaults = config_class()
    except Exception as error:
        raise Skip(f"config {config_class.__name__}() fails with its defaults: {first_line(error)}") from None
    for attribute, what in NEEDS_EXTERNAL:
        if getattr(defaults, attribute, False):
            raise Skip(f"needs {what}")
    overrides = shrunk_overrides(defaults.to_dict())
    if task in ("sequence-classification", "token-classification", "image-classification"):
        overrides["num_labels"] = LABELS
    if getattr(defaults, "use_cache", False):
        overrides["use_cache"] = False  # no key-value cache: the zoo runs one forward per step
    if getattr(defaults, "pad_token_id", None) is None:
        overrides["pad_token_id"] = 0
    if getattr(defaults, "is_encoder_decoder", False) and getattr(defaults, "decoder_start_token_id", None) is None:
        overrides["decoder_start_token_id"] = 0
    try:
        config = config_class(**overrides)
    except Exception as error:
        raise Skip(f"shrunk config does not build: {first_line(error)}") from None
    heads = getattr(config, "num_attention_heads", None)
    if isinstance(heads, int) and isinstance(getattr(config, "hidden_size", None), int):
        for name, derived in (("head_dim", config.hidden_size // heads), ("num_key_value_heads", heads)):
            if hasattr(config, name) and getattr(config, name) is None:
                setattr(config, name, derived)  # a default some configs derive only when loaded from a file
    return config


# --- building -----------------------------------------------------------------------------------


def first_line(error: BaseException) -> str:
    """An exception as one short line: its type and the first line of its message."""
    message = str(error).strip().splitlines()
    return f"{type(error).__name__}: {message[0][:300] if message else ''}".rstrip(": ")


def build_hf(case: Case) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A shrunk, randomly initialised float32 model of the case's class on CPU, and its inputs."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_class = getattr(transformers, case.model_class, None)
    if model_class is None:
        raise Skip(f"transformers has no {case.model_class} (a missing optional dependency?)")
    try:
        config_class = CONFIG_MAPPING[case.family]
    except Exception as error:
        raise Skip(f"no config class: {first_line(error)}") from None
    config = small_config(config_class, case.task)
    try:
        model = model_class(config)
    except ImportError as error:
        raise Skip(f"needs a package not installed: {first_line(error)}") from None
    except Exception as error:
        raise Skip(f"the shrunk model does not build on CPU: {first_line(error)}") from None
    randomize_constant_matrices(model, getattr(config, "initializer_range", 0.02))
    return model.float().eval(), TASKS[case.task].inputs(config)


def randomize_constant_matrices(model: nn.Module, std: float) -> list[str]:
    """Give every parameter of 2+ dimensions that the model's init left constant normal(0, std) values.

    A constant matrix ties every output feature of its matmul: a zero-initialised MoE router gate
    (afmoe's, ernie4_5_moe's) gives every expert the same score, and topk's choice among tied values is
    unspecified (CPU's comes from its partial-sort internals: experts 2 and 3 of 4), so CPU and pjrt
    would pick different experts for reasons no device controls. It also hides the matrix from the
    comparison (a lowering that dropped a zero position table would still match). Returns their names.
    """
    names = []
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            flat = parameter.reshape(-1)
            if parameter.dim() >= 2 and flat.numel() > 1 and bool((flat == flat[0]).all()):
                parameter.normal_(0.0, std)
                names.append(name)
    return names


def _load_module(source: str) -> Any:
    """A module by import name, or a .py file by path."""
    if source.endswith(".py") or os.sep in source:
        path = os.path.abspath(source)
        if not os.path.isfile(path):
            raise Skip(f"no file {path}")
        name = "torch_pjrt_zoo_user_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(source)


def user_cases(spec: str) -> list[Case]:
    """`module:factory` or `file.py:factory` names one factory; `module` or `file.py` alone names the
    factories in its `ZOO_MODELS` (a dict of name -> factory)."""
    source, _, attribute = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if attribute:
        return [Case(spec, "user", "user", factory=spec)]
    module = _load_module(source)
    factories = getattr(module, "ZOO_MODELS", None)
    if not isinstance(factories, dict) or not factories:
        raise ValueError(f"{source} has no ZOO_MODELS dict of name -> factory; add one, or name a factory "
                         f"as {source}:FACTORY")
    return [Case(f"{source}:{name}", "user", "user", factory=f"{source}:{name}") for name in factories]


def build_user(case: Case) -> tuple[nn.Module, Any]:
    """Call the user's factory: it returns (model, inputs)."""
    source, _, attribute = case.factory.rpartition(":")
    module = _load_module(source)
    factories = getattr(module, "ZOO_MODELS", None) or {}
    factory = factories.get(attribute) or getattr(module, attribute, None)
    if not callable(factory):
        raise Skip(f"{source} has no factory {attribute!r}")
    built = factory()
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], nn.Module)):
        raise Skip(f"factory {case.factory} must return (model, inputs), got {type(built).__name__}")
    model, inputs = built
    return model.eval(), inputs


# --- timm ------------------------------------------------------------------------------------------

LIBRARIES = ("transformers", "timm", "diffusers")
TIMM_IMAGE = 64  # the smallest side fed to a model whose input size is not fixed
TIMM_SIDE_STEP = 32  # a model that rejects TIMM_IMAGE gets the first larger multiple of this it accepts
TIMM_LARGEST_SIDE = 512
TIMM_MAX_PARAMETERS = 200_000_000  # a module whose smallest model is larger costs too much memory on this CPU


def _timm_meta_model(name: str) -> nn.Module:
    """timm's model `name` with LABELS classes on the meta device: its shapes without memory or init time."""
    import timm

    with torch.device("meta"):
        return timm.create_model(name, pretrained=False, num_classes=LABELS)


def timm_parameter_count(name: str) -> int:
    """Parameters of timm's model `name` with LABELS classes, counted on the meta device."""
    return sum(p.numel() for p in _timm_meta_model(name).parameters())


def timm_cases(modules: Iterable[str] | None = None) -> list[Case]:
    """One image classifier per timm model module (family = module; all modules, or `modules`): the model
    with the fewest parameters, counted on the meta device (a model that does not build there counts last)."""
    import timm

    def size(name: str) -> tuple[float, str]:
        try:
            return timm_parameter_count(name), name
        except Exception:
            return float("inf"), name

    cases = []
    for module in sorted(modules or timm.list_modules()):
        names = timm.list_models(module=module)
        if names:
            name = min(names, key=size) if len(names) > 1 else names[0]
            cases.append(Case(name, module, "image-classification", model_class=name, library="timm"))
    return cases


def timm_smallest_side(name: str, channels: int, fixed: int) -> int:
    """The smallest square side, from `fixed` up in steps of TIMM_SIDE_STEP, at which the model's forward
    runs on the meta device (an inception net's stem and reductions need more than 64); `fixed` when the
    meta device cannot tell (an op without a meta kernel)."""
    model = _timm_meta_model(name).eval()
    for side in range(fixed, TIMM_LARGEST_SIDE + 1, TIMM_SIDE_STEP):
        try:
            with torch.no_grad():
                model(torch.empty(1, channels, side, side, device="meta"))
            return side
        except (RuntimeError, ValueError, AssertionError) as error:
            if "meta" in str(error) and "size" not in str(error).lower():
                return fixed
    return fixed


def build_timm(case: Case) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """`timm.create_model` with random weights, no dropout, LABELS classes; random images of its input size,
    or of the smallest side it accepts from TIMM_IMAGE up."""
    import timm

    parameters = timm_parameter_count(case.model_class)
    if parameters > TIMM_MAX_PARAMETERS:
        raise Skip(f"{parameters / 1e6:.0f}M parameters in the module's smallest model, over the zoo's "
                   f"{TIMM_MAX_PARAMETERS / 1e6:.0f}M")
    options = {"pretrained": False, "num_classes": LABELS, "drop_rate": 0.0, "drop_path_rate": 0.0}
    for unused in ("drop_path_rate", "drop_rate", None):  # a model without stochastic depth or dropout rejects them
        try:
            model = timm.create_model(case.model_class, **options)
            break
        except TypeError as error:
            if unused is None or "drop" not in str(error):
                raise
            options.pop(unused)
    config = model.pretrained_cfg
    channels, height, width = config.get("input_size", (3, TIMM_IMAGE, TIMM_IMAGE))
    if not config.get("fixed_input_size", False):
        smallest = config.get("min_input_size", (channels, TIMM_IMAGE, TIMM_IMAGE))
        height = width = timm_smallest_side(case.model_class, channels, max(TIMM_IMAGE, smallest[1], smallest[2]))
    randomize_constant_matrices(model, 0.02)
    return model.float().eval(), (torch.randn(BATCH, channels, height, width),)
