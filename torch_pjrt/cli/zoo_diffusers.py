"""The zoo's diffusers catalog (`torch-pjrt zoo --library diffusers`): every model class diffusers exports under
`diffusers.models`, built from its constructor's defaults shrunk to a small size, with random weights.

Nothing is downloaded. A class's forward takes inputs of its own kind (latent images or video, packed
tokens, text embeddings, timesteps, position ids); they are synthesised from the forward's argument names
and the shrunk config, and where a shape cannot be told from the config (an image, a video or a token
sequence) the candidates are tried on CPU in order and the first the model accepts is the one both
devices run. A class none fits is skipped with the CPU error of the last candidate.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn

from torch_pjrt.cli.zoo_catalog import BATCH, Case, Skip, first_line, randomize_constant_matrices

SIDE = 32  # the side of an image or latent fed to a model (its sample_size where smaller)
FRAMES = (5, 2)  # frame counts tried for video models: 1 + 4k for causal video VAEs, then an even count
TEXT_TOKENS = 8
LENGTH = 64  # the length of a 1-D (audio) sample
MAX_PARAMETERS = 200_000_000
# Constructor arguments that count layers or blocks take LAYERS (per block: 1); head counts at most HEADS;
# channel lists keep their length with widths from CHANNELS doubling once (multiples of 32: norm groups).
LAYERS, HEADS, CHANNELS = 2, 2, 32
LAYER_COUNT = re.compile(r"^(\w*num_\w*layers|n_\w*layers|\w*depth\w*|num_\w*blocks|mmdit_layers)$")
PER_BLOCK_COUNTS = ("layers_per_block", "transformer_layers_per_block", "num_res_blocks", "layers_per_block_up")
HEAD_COUNT = re.compile(r"^(\w*num_\w*heads|n_\w*heads|heads)$")
CHANNEL_LISTS = ("block_out_channels", "conditioning_embedding_out_channels", "encoder_block_out_channels",
                 "decoder_block_out_channels", "channel_multipliers")
# Widths made small only for a model still over MAX_PARAMETERS with its counts shrunk (a width is often tied to
# another, e.g. rotary axes to the head size, so they are left alone where the counts are enough).
WIDTH = re.compile(r"^(\w*hidden_size|\w*hidden_dim|inner_dim|dim|model_dim|d_model|\w*embed_dim|ffn_dim|"
                   r"intermediate_size|mlp_dim|\w*_channels_hidden)$")
WIDE = 128
# Where the width of the text embeddings a model cross-attends to is configured, most specific first.
TEXT_WIDTHS = ("joint_attention_dim", "caption_channels", "cross_attention_dim", "text_embed_dim", "text_dim",
               "encoder_hid_dim", "context_dim", "text_hidden_dim", "text_states_dim", "cross_attn_dim",
               "encoder_hidden_size", "caption_dim", "cap_feat_dim", "context_in_dim")
POOLED_WIDTHS = ("pooled_projection_dim", "projection_dim", "pooled_dim", "clip_txt_pooled_dim", "text_embed_dim",
                 "cond_embed_dim")
CHANNEL_NAMES = ("audio_channels", "in_channels", "latent_channels", "num_channels", "in_dim", "c_in", "out_channels")
# RFD4-Proteina's residue tables, left to its checkpoint: the atom37 slots each of its 147 residue types fills (the
# 4 backbone atoms and up to 33 side-chain ones, by type) and the residue types each of its 7 token types may decode to.
RFD4_ATOM_SLOTS = [[slot < 4 + residue % 34 for slot in range(37)] for residue in range(147)]
RFD4_ALLOWED_RESIDUES = [[True] * 147 for _ in range(7)]
# Constructor arguments of classes whose defaults leave a size to a checkpoint's config (None) or that no longer
# build once shrunk (norm groups wider than the shrunk channels, heads wider than the width): small values.
CONSTRUCTOR_OVERRIDES: dict[str, dict[str, Any]] = {
    "HunyuanDiT2DModel": {"in_channels": 4, "patch_size": 2, "hidden_size": 2 * 88},  # heads x head size
    "HunyuanDiT2DControlNetModel": {"in_channels": 4, "patch_size": 2, "hidden_size": 2 * 88,
                                    "transformer_num_layers": 4},  # one control block per 2 layers, less one
    "Transformer2DModel": {"in_channels": 32},
    "DreamLiteTransformer2DModel": {"in_channels": 32},
    "TransformerTemporalModel": {"in_channels": 32},
    "DreamLiteUNetModel": {"attention_head_dim": 16},
    "LuminaNextDiT2DModel": {"num_kv_heads": 2, "hidden_size": 256},  # 182M at 2304
    # Left to its checkpoint: its T5 and Llama widths, one Llama layer's states per block of the shrunk 2 + 2, and
    # rotary axes for its 3 id columns (head size 128).
    "HiDreamImageTransformer2DModel": {"patch_size": 2, "caption_channels": (4096, 4096), "llama_layers": (0, 1, 2, 3),
                                       "axes_dims_rope": (64, 32, 32)},
    # Channels doubling at each level as its defaults do, heads of 16 (2 at the first level), 2 layers per block (with
    # 1 its up blocks' conditional norms get the wrong width), text and time widths 256 (113M parameters at 4096).
    "Kandinsky3UNet": {"groups": 8, "block_out_channels": (32, 64, 128, 256), "attention_head_dim": 16,
                       "layers_per_block": 2, "cross_attention_dim": 256, "encoder_hid_dim": 256,
                       "time_embedding_dim": 256},
    "AutoencoderKLHunyuanImage": {"in_channels": 3, "out_channels": 3, "latent_channels": 16, "layers_per_block": 1,
                                  "block_out_channels": (32, 64, 64), "spatial_compression_ratio": 4,
                                  "sample_size": SIDE},  # all left to the checkpoint; 2 downsamplings
    # Widths tied to heads x head size or to the rotary axes, at 2 heads.
    "AuraFlowTransformer2DModel": {"caption_projection_dim": 512},
    "Lumina2Transformer2DModel": {"hidden_size": 192},
    "PRXTransformer2DModel": {"hidden_size": 128},
    "SanaTransformer2DModel": {"cross_attention_dim": 64, "cross_attention_head_dim": 32},
    "SanaControlNetModel": {"cross_attention_dim": 64, "cross_attention_head_dim": 32},
    "UNet1DModel": {"extra_in_channels": 64},  # the Fourier time features it concatenates to the sample
    "AutoencoderTiny": {"encoder_block_out_channels": (32,) * 4, "decoder_block_out_channels": (32,) * 4},
    "CogVideoXTransformer3DModel": {"max_text_seq_length": TEXT_TOKENS},  # its position table spans the text
    "ConsisIDTransformer3DModel": {"max_text_seq_length": TEXT_TOKENS},
    "UNet3DConditionModel": {"attention_head_dim": 8},  # heads = channels / head size, 0 at 64 with 32 channels
    # Base widths of autoencoders the generic rules do not name (over MAX_PARAMETERS otherwise).
    "AutoencoderKLKVAE": {"channels": 32},
    "AutoencoderKLKVAEVideo": {"ch": 32},
    "AutoencoderKLQwenImage21": {"base_dim": 32, "decoder_base_dim": 32},
    "MMAudioVAE": {"hidden_channels": 64},
    "Cosmos3AVAEAudioTokenizer": {"dec_dim": 32, "enc_dim": 32, "enc_intermediate_dim": 128},
    "StableCascadeUNet": {"down_num_layers_per_block": (1, 1), "up_num_layers_per_block": (1, 1),
                          "num_attention_heads": (2, 2), "dropout": (0.0, 0.0)},
    "I2VGenXLUNet": {"attention_head_dim": 8},
    "LTXVideoTransformer3DModel": {"cross_attention_dim": 128},  # heads x head size, at 2 heads
    # SDXL's time embedding width (it embeds the control types with it); its control-type transformer at CHANNELS.
    "ControlNetUnionModel": {"addition_time_embed_dim": 256, "num_trans_channel": CHANNELS,
                             "num_proj_channel": CHANNELS},
    "CosmosControlNetModel": {"model_channels": 2 * 128},  # heads x head size, at 2 heads
    "SD3ControlNetModel": {"caption_projection_dim": 128},  # heads x head size, at 2 heads (108M at 18 heads)
    "AllegroTransformer3DModel": {"cross_attention_dim": 2 * 96},  # heads x head size, at 2 heads
    # 2 heads of its rotary axes' 128; text injected into the second of its 2 layers (its checkpoint: 5 of 44).
    "BriaFibo2Transformer2DModel": {"dim": 2 * 128, "injection_layer_ids": (1,)},
    "LTX2VideoTransformer3DModel": {"cross_attention_dim": 2 * 128, "audio_cross_attention_dim": 2 * 64},
    # The released FramePack checkpoints' image projection and history embedder, which its forward always calls.
    "HunyuanVideoFramepackTransformer3DModel": {"has_image_proj": True, "has_clean_x_embedder": True},
    "SanaWMLTX2RefinerTransformer3DModel": {"cross_attention_dim": 2 * 128, "audio_cross_attention_dim": 2 * 64},
    "SanaWMTransformer3DModel": {"hidden_size": 2 * 112},  # heads x its linear attention's head size, at 2 heads
    "SanaVideoTransformer3DModel": {"cross_attention_dim": 2 * 112},  # cross heads x head size, at 2 heads
    "StableAudio3DiTModel": {"embed_dim": 2 * 64},  # 146M at 1536
    "AceStepTransformer1DModel": {"hidden_size": 256, "intermediate_size": 512},  # 149M at 2048
    "JoyImageEditTransformer3DModel": {"hidden_size": 2 * 128},  # 2 heads of its rotary axes' 128
    "JoyImageEditPlusTransformer3DModel": {"hidden_size": 2 * 128},
    "Kandinsky6SRLatentUpscalerBank": {"stage_channels": (128, 64, 32), "num_pre_blocks": 1, "num_mid_blocks": 1,
                                       "num_post_blocks": 1, "num_x2_adapter_blocks": 1},  # 2078M at its widths
    "LongCatAudioDiTTransformer": {"dit_dim": 256},  # 151M at 1536
    # Audio models' widths (over a minute on pjrt at their defaults).
    "AutoencoderOobleck": {"decoder_channels": 32},
    "AutoencoderKLMiniMaxH3Audio": {"decoder_dim": 256},
    "MMAudioVocoder": {"upsample_initial_channel": 64},
    "MiniMaxMusic3Vocoder": {"decoder_input_dim": 128, "decoder_hidden_dim": 128},
    "AutoencoderVidTok": {"ch": 32},  # no result in 300 s at 128
    "ErnieImageTransformer2DModel": {"hidden_size": 256, "ffn_hidden_size": 512},  # 2 heads of the rotary's 128
    "EasyAnimateTransformer3DModel": {"in_channels": 16, "out_channels": 16, "patch_size": 2},
    "LatteTransformer3DModel": {"in_channels": 4, "out_channels": 4, "patch_size": 2, "caption_channels": 32,
                                "video_length": FRAMES[0]},  # its frame position table spans the clip
    "ZImageTransformer2DModel": {"dim": 256},  # 2 heads of the rotary axes' 128
    "WanVACETransformer3DModel": {"vace_layers": [0, 1]},  # every block of the shrunk model takes a VACE hint
    # Its motion encoder halves a square face image down to 4 pixels: 16-pixel faces (512 in its checkpoint); a face
    # adapter after the first of every 2 blocks (of 5 in its checkpoint: none in 2 blocks).
    "WanAnimateTransformer3DModel": {"motion_encoder_size": 16, "inject_face_latents_blocks": 2,
                                     "motion_encoder_channel_sizes": {"4": CHANNELS, "8": CHANNELS, "16": CHANNELS}},
    "UNetSpatioTemporalConditionModel": {"num_attention_heads": (2, 2, 2, 2)},  # 5 heads of 32 channels: 30
    # Two of its four blocks (over 300 s on pjrt fused with four), at the widths of its UNet's; one motion module per
    # resnet of its UNet.
    "ControlNetXSAdapter": {"down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"), "block_out_channels": (4, 8),
                            "base_block_out_channels": (CHANNELS, 2 * CHANNELS)},
    "MotionAdapter": {"motion_layers_per_block": 1},
    # Z-Image's union ControlNet: a control block at each of the shrunk transformer's 2 layers, VAE latents in, its
    # transformer's width (2 heads of the rotary axes' 128).
    "ZImageControlNetModel": {"control_layers_places": (0, 1), "control_in_dim": 16, "dim": 256},
    "RFD4ProteinaAutoencoder": {"nlayers": LAYERS, "nheads": HEADS, "token_dim": 2 * 64, "atom37_mask": RFD4_ATOM_SLOTS,
                                "allowed_residue_types": RFD4_ALLOWED_RESIDUES},
    # Channels doubling at each stage as its defaults do (its down- and upsamplers split and fold channels by their
    # factor).
    "AutoencoderKLLTX2Video": {"block_out_channels": (32, 64, 128, 256), "decoder_block_out_channels": (32, 64, 128)},
    # Tiles wider than its fixed 120- and 80-pixel tile overlaps (its tile side is its sample size).
    "AutoencoderKLAllegro": {"sample_size": 128},
    # Phi-3's rotary scaling, left to its checkpoint: one short and one long factor per rotary frequency of its
    # head size (2 heads of 64), its width and MLP at that size (3072 wide, its 32064-token embedding alone is 98M).
    "OmniGenTransformer2DModel": {"hidden_size": 2 * 64, "intermediate_size": 256, "rope_scaling": {
        "short_factor": [1.0 + index / 64 for index in range(32)],
        "long_factor": [1.0 + index / 8 for index in range(32)]}},
    "LTX2VideoDiffusionDecoderModel": {"decoder_stage_channels": (128, 64, 32, 32, 16),
                                       "decoder_stage_depths": (1, 1, 1, 1, 1)},
}
# Optional forward arguments a class cannot run without (None where its pipeline always passes them).
NEEDED_OPTIONAL: dict[str, tuple[str, ...]] = {
    "LTXVideoTransformer3DModel": ("num_frames", "height", "width"),
    "Kandinsky3UNet": ("encoder_attention_mask",),
    "I2VGenXLUNet": ("image_embeddings",),
}


def model_classes() -> list[str]:
    """Every class exported under diffusers.models that is a model (a ModelMixin other than the base ones)."""
    import diffusers.models as models
    from diffusers import ModelMixin

    return sorted(name for name in dir(models)
                  if isinstance(getattr(models, name), type) and issubclass(getattr(models, name), ModelMixin)
                  and name not in ("ModelMixin", "AutoModel"))


def family(name: str) -> str:
    """The kind of model a class name says it is."""
    lower = name.lower()
    for word in ("controlnet", "adapter", "autoencoder", "vae", "unet", "prior", "transformer", "vocoder"):
        if word in lower:
            return word
    return "other"


def diffusers_cases() -> list[Case]:
    return [Case(name, family(name), "diffusion", model_class=name, library="diffusers")
            for name in model_classes()]


def _shrunk(name: str, value: Any) -> Any:
    if isinstance(value, bool) or value is None:
        return value
    if LAYER_COUNT.match(name) and isinstance(value, int) and name not in PER_BLOCK_COUNTS:
        return min(value, LAYERS)
    if name in PER_BLOCK_COUNTS:
        if isinstance(value, int):
            return min(value, 1)
        if isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
            return type(value)(min(v, 1) for v in value)
    if HEAD_COUNT.match(name) and isinstance(value, int):
        return min(value, HEADS)
    if name in CHANNEL_LISTS and isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        if name == "channel_multipliers":
            return value
        return type(value)(min(v, CHANNELS * 2 ** min(i, 1)) for i, v in enumerate(value))
    if isinstance(value, float) and ("dropout" in name or "drop_path" in name):
        return 0.0
    if name == "sample_size" and isinstance(value, int):
        return min(value, SIDE)
    return value


def small_arguments(model_class: type, widths: bool = False, heads: bool = True) -> dict[str, Any]:
    """The constructor's defaults with layer, head (with `heads`) and channel counts made small (and widths, with
    `widths`)."""
    arguments = {}
    overrides = CONSTRUCTOR_OVERRIDES.get(model_class.__name__, {})
    for name, parameter in inspect.signature(model_class.__init__).parameters.items():
        if name == "self" or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is inspect.Parameter.empty and name not in overrides:
            raise Skip(f"its constructor needs {name!r}, which has no default")
        small = parameter.default if not heads and HEAD_COUNT.match(name) else _shrunk(name, parameter.default)
        if widths and WIDTH.match(name) and isinstance(small, int) and not isinstance(small, bool) and small > WIDE:
            small = WIDE
        if small is not parameter.default:
            arguments[name] = small
    return arguments | overrides


def _config_int(config: Any, names: tuple[str, ...], default: int | None = None) -> int | None:
    for name in names:
        value = config.get(name) if isinstance(config, dict) else getattr(config, name, None)
        if isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return default


class _Shapes:
    """The sizes one candidate uses: the main input's layout (image, video or tokens) and its side."""

    def __init__(self, config: dict[str, Any], layout: str, frames: int = 1, fractions: bool = False,
                 channels: int | None = None, length: int = LENGTH) -> None:
        self.config, self.layout, self.frames, self.fractions, self.length = config, layout, frames, fractions, length
        sample = config.get("sample_size")
        self.side = min(sample, SIDE) if isinstance(sample, int) and sample >= 8 else SIDE
        self.channels = channels or _channels(config)
        self.text_width = _config_int(config, TEXT_WIDTHS, 32)
        patch = _config_int(config, ("patch_size",), 1)
        self.tokens = (self.side // max(patch, 1)) ** 2 if layout == "tokens" else 0

    def main(self) -> torch.Tensor:
        if self.layout == "image":
            return torch.randn(BATCH, self.channels, self.side, self.side)
        if self.layout == "video":
            return torch.randn(BATCH, self.channels, self.frames, self.side, self.side)
        if self.layout == "frames-first video":
            return torch.randn(BATCH, self.frames, self.channels, self.side, self.side)
        if self.layout == "vector":
            return torch.randn(BATCH, _config_int(self.config, ("embedding_dim",), self.channels))
        if self.layout == "sequence":
            return torch.randn(BATCH, self.channels, self.length)
        return torch.randn(BATCH, self.side * self.side // 4, self.channels)  # packed latent tokens

    def text(self) -> torch.Tensor:
        """Text embeddings; one set per text-encoder layer where the config counts the layers it fuses."""
        layers = self.config.get("num_text_layers")
        if isinstance(layers, int):
            return torch.randn(BATCH, TEXT_TOKENS, layers, self.text_width)
        return torch.randn(BATCH, TEXT_TOKENS, self.text_width)

    def positions(self, count: int) -> torch.Tensor:
        """Position ids, one column per rotary axis the config names (3 where it names none)."""
        axes = self.config.get("axes_dims_rope") or self.config.get("axes_dim")
        return torch.randint(0, 16, (count, len(axes) if isinstance(axes, (list, tuple)) else 3)).float()


def _timestep() -> torch.Tensor:
    """Steps of a 1000-step schedule, away from its ends."""
    return torch.rand(BATCH) * 900 + 50


# A model that multiplies its timestep by 1000 itself (Flux and its kin in forward, AuraFlow and Qwen-Image in a
# Timesteps projection with scale 1000, Z-Image and LTX by a config factor) is passed the schedule's fraction.
SCALES_TIMESTEP = re.compile(r"\btimesteps?\b[^\n]*\*\s*(1000|1e3)\b")
TIMESTEP_FACTORS = ("t_scale", "timestep_scale_multiplier", "time_factor")


def _takes_fractions(model: nn.Module) -> bool:
    """Whether the model scales a timestep in [0, 1) up to the 1000-step schedule itself."""
    from diffusers.models.embeddings import Timesteps

    config = dict(getattr(model, "config", {}) or {})
    if any(config.get(name) == 1000 for name in TIMESTEP_FACTORS):
        return True
    if any(isinstance(module, Timesteps) and module.scale == 1000 for module in model.modules()):
        return True
    for module_class in {type(module) for module in model.modules()}:  # its own forward or a time embedding's
        try:
            if SCALES_TIMESTEP.search(inspect.getsource(module_class.forward)):
                return True
        except (OSError, TypeError):
            continue
    return False


def _argument(name: str, shapes: _Shapes) -> Any:
    """A value for forward argument `name`, or KeyError when the zoo has no rule for it."""
    config = shapes.config
    if name in ("sample", "hidden_states", "x", "latents", "z", "mel", "controls_latents"):
        return shapes.main()
    if name in ("timestep", "timesteps", "t", "timestep_ratio", "decoder_noise_time", "r_timestep", "timestep_r"):
        fraction = shapes.fractions or name in ("timestep_ratio", "decoder_noise_time")
        return _timestep() / (1000 if fraction else 1)
    if name in ("encoder_hidden_states", "cap_feats", "encoder_hidden_states_t5", "context_latents"):
        return shapes.text()
    if name in ("encoder_attention_mask", "encoder_mask", "text_embedding_mask"):
        return torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long)
    if name in ("pooled_projections", "pooled_text_emb", "pooled_embeds", "global_hidden_states"):
        return torch.randn(BATCH, _config_int(config, POOLED_WIDTHS, 32))
    if name == "img_ids":
        return shapes.positions(shapes.main().shape[1])
    if name == "txt_ids":
        return shapes.positions(TEXT_TOKENS)
    if name == "img_shapes":  # (frames, height, width) of the packed latent, per sample
        side = round(shapes.main().shape[1] ** 0.5)
        return [[(1, side, side)]] * BATCH
    if name == "text_encoder_layers":  # one text encoder layer's states per transformer block
        count = config.get("num_layers", 0) + config.get("num_single_layers", 0)
        width = _config_int(config, ("text_encoder_dim",), shapes.text_width)
        return [torch.randn(BATCH, TEXT_TOKENS, width) for _ in range(count)]
    if name in ("num_frames", "height", "width"):  # the latent grid a packed or 5-D input holds
        if shapes.layout == "tokens":
            return 1 if name == "num_frames" else round(shapes.main().shape[1] ** 0.5)
        return shapes.frames if name == "num_frames" else shapes.side
    if name == "image_embeddings":  # a CLIP image embedding
        return torch.randn(BATCH, _config_int(config, ("cross_attention_dim",), 32))
    if name == "image_latents":  # the first frame's latents, as a video like the sample
        return shapes.main()
    if name == "clip_text_pooled":
        return torch.randn(BATCH, 1, _config_int(config, ("clip_text_pooled_in_channels",), 32))
    if name == "inputs_embeds":
        return torch.randn(BATCH, TEXT_TOKENS, _config_int(config, ("hidden_size",), 32))
    if name == "position_ids":  # (text tokens + image tokens, axes), text first
        return shapes.positions(TEXT_TOKENS + shapes.main().shape[1])
    if name == "input_ids" and "codebook_size" in config:  # VQ image tokens
        return torch.randint(0, config["codebook_size"], (BATCH, shapes.side, shapes.side))
    if name == "micro_conds":  # original width and height, crop top and left, aesthetic score
        return torch.tensor([[shapes.side * 8.0, shapes.side * 8.0, 0.0, 0.0, 6.0]] * BATCH)
    if name == "guidance":
        return torch.rand(BATCH) * 4 + 1
    if name == "controlnet_cond":
        channels = _config_int(config, ("conditioning_channels",), None)
        if channels is not None and shapes.layout == "image":  # an image at 8x the latent's side
            return torch.randn(BATCH, channels, shapes.side * 8, shapes.side * 8)
        return shapes.main()
    if name == "conditioning_scale":
        return 1.0
    if name == "class_labels":
        classes = _config_int(config, ("num_embeds_ada_norm", "num_class_embeds"), 10)
        return torch.randint(0, classes, (BATCH,))
    if name in ("original_size", "target_size", "crop_coords"):
        return torch.tensor([[shapes.side * 8.0, shapes.side * 8.0]] * BATCH)
    if name == "added_time_ids":
        width = _config_int(config, ("projection_class_embeddings_input_dim",), 768)
        per_id = _config_int(config, ("addition_time_embed_dim",), 256)
        return torch.rand(BATCH, width // per_id) * 10
    if name == "fps":
        return torch.full((BATCH,), 8)
    if name == "proj_embedding":
        return torch.randn(BATCH, _config_int(config, ("embedding_dim",), 32))
    raise KeyError(name)


def _text(config: dict[str, Any], batch: int = BATCH, tokens: int = TEXT_TOKENS) -> torch.Tensor:
    return torch.randn(batch, tokens, _config_int(config, TEXT_WIDTHS, 32))


def _channels(config: dict[str, Any]) -> int:
    return _config_int(config, CHANNEL_NAMES, 4)


def _ideogram_packed(config: dict[str, Any]) -> dict[str, Any]:
    """One packed sequence per sample: text tokens (role 3) then a latent grid's patches (role 2), each row holding
    both the latent and the text features (the model masks each by role), (t, h, w) positions with the image's
    offset past the text, one segment per sample, and the model time its pipeline passes (its sinusoidal embedding
    scales [0, 1] by 1e4: a 1000-step timestep makes float32's last bit of a frequency swing its phase by a radian)."""
    side = SIDE // 4
    length = TEXT_TOKENS + side * side
    indicator = torch.cat([torch.full((TEXT_TOKENS,), 3), torch.full((side * side,), 2)]).expand(BATCH, length)
    rows, columns = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    image = torch.stack([torch.zeros(side * side, dtype=torch.long), rows.flatten(), columns.flatten()], 1) + 65536
    text = torch.arange(TEXT_TOKENS)[:, None].expand(TEXT_TOKENS, 3)
    return {"hidden_states": torch.randn(BATCH, length, config["in_channels"]),
            "encoder_hidden_states": torch.randn(BATCH, length, config["llm_features_dim"]),
            "position_ids": torch.cat([text, image]).expand(BATCH, length, 3).contiguous(),
            "segment_ids": torch.zeros(BATCH, length, dtype=torch.long), "indicator": indicator.contiguous(),
            "timestep": 1 - _timestep() / 1000}  # model time in [0, 1] (0 noise, 1 data), as its pipeline maps sigma


def _hunyuan_dit(config: dict[str, Any]) -> dict[str, Any]:
    """What HunyuanDiT's pipeline passes: CLIP and T5 text states with their masks, the latent grid's 2-D rotary
    table, image size metadata and a style id."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    grid = SIDE // config["patch_size"]
    rotary = get_2d_rotary_pos_embed(config["attention_head_dim"], ((0, 0), (grid, grid)), (grid, grid),
                                     output_type="pt")
    return {"hidden_states": torch.randn(BATCH, config["in_channels"], SIDE, SIDE),
            "encoder_hidden_states": torch.randn(BATCH, config["text_len"], config["cross_attention_dim"]),
            "text_embedding_mask": torch.ones(BATCH, config["text_len"], dtype=torch.long),
            "encoder_hidden_states_t5": torch.randn(BATCH, config["text_len_t5"], config["cross_attention_dim_t5"]),
            "text_embedding_mask_t5": torch.ones(BATCH, config["text_len_t5"], dtype=torch.long),
            "image_meta_size": torch.tensor([[SIDE * 8.0, SIDE * 8.0, SIDE * 8.0, SIDE * 8.0, 0.0, 0.0]] * BATCH),
            "style": torch.zeros(BATCH, dtype=torch.long), "image_rotary_emb": rotary}


def _lumina_next(config: dict[str, Any]) -> dict[str, Any]:
    """Lumina-Next's pipeline passes its 2-D complex rotary table (the model crops it to the latent grid) and the
    text mask."""
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    head = config["hidden_size"] // config["num_attention_heads"]
    return {"image_rotary_emb": get_2d_rotary_pos_embed_lumina(head, SIDE, SIDE),
            "encoder_mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long), "cross_attention_kwargs": {}}


def _kandinsky5(config: dict[str, Any]) -> dict[str, Any]:
    """A channels-last latent video (batch, frames, height, width, channels) with the (t, h, w) rotary positions of
    its patch grid and the text tokens' positions, as Kandinsky 5's pipeline builds them."""
    frames, side = FRAMES[1], SIDE // 2
    patch = config["patch_size"]
    return {"hidden_states": torch.randn(BATCH, frames, side, side, config["in_visual_dim"]),
            "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["in_text_dim"]),
            "pooled_projections": torch.randn(BATCH, config["in_text_dim2"]),
            "visual_rope_pos": [torch.arange(frames // patch[0]), torch.arange(side // patch[1]),
                                torch.arange(side // patch[2])],
            "text_rope_pos": torch.arange(TEXT_TOKENS)}


def _kandinsky6(config: dict[str, Any]) -> dict[str, Any]:
    """A channels-last latent video holding the noisy latent, the conditioning latent and its mask (2 x latent + 1
    channels where the config conditions on video), with the prompt's token and pooled states (none for the
    super-resolution model, which takes the video alone)."""
    channels = 2 * config["in_visual_dim"] + 1 if config.get("visual_cond", True) else config["in_visual_dim"]
    inputs = {"hidden_states": torch.randn(BATCH, FRAMES[1], SIDE // 2, SIDE // 2, channels)}
    if "in_text_dim" in config:
        inputs |= {"encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["in_text_dim"]),
                   "pooled_projections": torch.randn(BATCH, config["in_text_dim2"])}
    return inputs


def _ace_step(config: dict[str, Any]) -> dict[str, Any]:
    """Acoustic latents as tokens, the context latents it concatenates to them (the rest of its input channels), the
    condition encoder's states of the model width, and a sigma in [0, 1] as both t and r (its pipeline's scheduler
    counts one train timestep; r = t in standard inference)."""
    sigma = _timestep() / 1000
    acoustic = config["audio_acoustic_hidden_dim"]
    return {"hidden_states": torch.randn(BATCH, LENGTH, acoustic),
            "context_latents": torch.randn(BATCH, LENGTH, config["in_channels"] - acoustic),
            "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["hidden_size"]),
            "timestep": sigma, "timestep_r": sigma.clone()}


def _cosmos(config: dict[str, Any], control: bool = False) -> dict[str, Any]:
    """Cosmos's latent video with the padding mask it concatenates (and, for its ControlNet, the control video, the
    base latents and the conditioning mask its pipeline passes)."""
    video = (BATCH, 16 if control else config["in_channels"], FRAMES[1], SIDE, SIDE)
    inputs = {"padding_mask": torch.zeros(1, 1, SIDE, SIDE)}  # one for the batch (the model repeats it)
    if control:
        return inputs | {"controls_latents": torch.randn(video), "latents": torch.randn(video),
                         "condition_mask": (torch.rand(BATCH, 1, FRAMES[1], SIDE, SIDE) > 0.5).float()}
    return inputs | {"hidden_states": torch.randn(video)}


def _ltx2(config: dict[str, Any]) -> dict[str, Any]:
    """LTX-2's pipeline: packed video latent tokens of a 2-frame side/2 grid with that grid's size, packed audio latent
    frames with their count, the text connector's states of the caption width for each modality with their mask, and
    the scheduler's step already scaled to 1000 as both timestep and sigma (its pipeline passes the same)."""
    side, audio_frames = SIDE // 2, TEXT_TOKENS
    step = _timestep()
    return {"hidden_states": torch.randn(BATCH, FRAMES[1] * side * side, config["in_channels"]),
            "audio_hidden_states": torch.randn(BATCH, audio_frames, config["audio_in_channels"]),
            "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["caption_channels"]),
            "audio_encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["caption_channels"]),
            "encoder_attention_mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
            "audio_encoder_attention_mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
            "timestep": step, "sigma": step.clone(), "num_frames": FRAMES[1], "height": side, "width": side,
            "fps": 24.0, "audio_num_frames": audio_frames}


def _framepack(config: dict[str, Any]) -> dict[str, Any]:
    """FramePack's pipeline, vanilla sampling: the window's latent video after the first image's latent and a history
    of 16, 2 and 1 frames (embedded at 4x, 2x and 1x), each with its frame indices in that order; the clean latents
    are the first image's and the 1x history frame; a SigLIP image embedding, the prompt's states, pooled CLIP states
    and the distilled guidance (scale x 1000)."""
    history_sizes, window, side = (16, 2, 1), FRAMES[1], SIDE // 2
    prefix, history_4x, history_2x, history_1x, latents = torch.arange(1 + sum(history_sizes) + window).split(
        [1, *history_sizes, window])

    def video(frames: int) -> torch.Tensor:
        return torch.randn(BATCH, config["in_channels"], frames, side, side)

    return {"hidden_states": video(window), "indices_latents": latents, "timestep": _timestep(),
            "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["text_embed_dim"]),
            "encoder_attention_mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
            "pooled_projections": torch.randn(BATCH, config["pooled_projection_dim"]),
            "image_embeds": torch.randn(BATCH, TEXT_TOKENS, config["image_proj_dim"]),
            "guidance": torch.full((BATCH,), 6000.0),
            "latents_clean": video(2), "indices_latents_clean": torch.cat([prefix, history_1x]),
            "latents_history_2x": video(history_sizes[1]), "indices_latents_history_2x": history_2x,
            "latents_history_4x": video(history_sizes[0]), "indices_latents_history_4x": history_4x}


def _anyflow(config: dict[str, Any]) -> dict[str, Any]:
    """AnyFlow's pipeline: per-frame latents (batch, frames, channels, height, width), and one flow-map step per frame
    from timestep t to the next sigma's r < t, both in train-timestep units."""
    t = _timestep()[:, None].expand(BATCH, FRAMES[1])
    return {"hidden_states": torch.randn(BATCH, FRAMES[1], config["in_channels"], SIDE, SIDE),
            "timestep": t.contiguous(), "r_timestep": (t * torch.rand(BATCH, 1)).contiguous()}


def _sana_wm(config: dict[str, Any]) -> dict[str, Any]:
    """SANA-WM's pipeline: a latent video, a timestep per latent frame, the prompt's states (one set) with their padding
    mask, the image size, and the camera's raymap and Plucker chunks from its own camera preparation, here for a camera
    moving straight ahead over the 1 + 8k frames an LTX-2 VAE (8x in time, 32x in space) encodes to the latent."""
    import numpy as np
    from diffusers.pipelines.sana_wm.cam_utils import prepare_camera

    frames = 1 + 8 * (FRAMES[1] - 1)
    poses = np.tile(np.eye(4, dtype=np.float32), (frames, 1, 1))
    poses[:, 2, 3] = np.linspace(0.0, 1.0, frames)
    intrinsics = np.tile(np.array([SIDE * 16.0] * 4, dtype=np.float32), (frames, 1))  # focal lengths and centre
    camera = prepare_camera(poses, intrinsics, target_size=(SIDE * 32, SIDE * 32), vae_stride=(8, 32, 32))
    return {"hidden_states": torch.randn(BATCH, config["in_channels"], FRAMES[1], SIDE, SIDE),
            "timestep": torch.rand(BATCH, 1, FRAMES[1]) * 900 + 50,
            "encoder_hidden_states": torch.randn(BATCH, 1, TEXT_TOKENS, config["caption_channels"]),
            "mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
            "data_info": {"img_hw": torch.tensor([[SIDE * 32.0, SIDE * 32.0]])},
            "camera_conditions": camera["raymap"].expand(BATCH, -1, -1).contiguous(),
            "chunk_plucker": camera["chunk_plucker"].expand(BATCH, -1, -1, -1, -1).contiguous()}


def _omnigen(config: dict[str, Any]) -> dict[str, Any]:
    """OmniGen's processor for an editing prompt: text ids with one input image's latent tokens in place of its
    placeholder, positions over text, time token and output image, and its mask: causal over the prompt and time
    token, bidirectional within the input image, the output image's tokens seeing everything."""
    latent_side, patch = SIDE // 4, config["patch_size"]
    image_tokens, output_tokens = (latent_side // patch) ** 2, (SIDE // patch) ** 2
    prompt = TEXT_TOKENS + image_tokens
    start = 2  # after "<img>"-like text tokens, as its processor places an image
    length = prompt + 1 + output_tokens
    mask = torch.cat([torch.cat([torch.ones(prompt + 1, prompt + 1).tril(), torch.zeros(prompt + 1, output_tokens)], 1),
                      torch.ones(output_tokens, length)])
    mask[start:start + image_tokens, start:start + image_tokens] = 1
    return {"input_ids": torch.randint(0, config["vocab_size"], (BATCH, prompt)),
            "input_img_latents": [torch.randn(1, config["in_channels"], latent_side, latent_side)
                                  for _ in range(BATCH)],
            "input_image_sizes": {sample: [[start, start + image_tokens]] for sample in range(BATCH)},
            "attention_mask": mask.expand(BATCH, -1, -1).contiguous(),
            "position_ids": torch.arange(length).expand(BATCH, -1).contiguous()}


def _stable_audio(config: dict[str, Any]) -> dict[str, Any]:
    """Stable Audio's pipeline: a latent waveform, the prompt's and the duration's states, the duration states as
    the global token it prepends, and the real 1-D rotary table over the waveform and that token."""
    from diffusers.models.embeddings import get_1d_rotary_pos_embed

    return {"hidden_states": torch.randn(BATCH, config["in_channels"], LENGTH),
            "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["cross_attention_input_dim"]),
            "global_hidden_states": torch.randn(BATCH, 1, config["global_states_input_dim"]),
            "rotary_embedding": get_1d_rotary_pos_embed(config["attention_head_dim"] // 2, LENGTH + 1, use_real=True,
                                                        repeat_interleave_real=False)}


def _wan_animate(config: dict[str, Any]) -> dict[str, Any]:
    """Wan Animate's pipeline, one segment of 1 + 4 (T - 1) frames: T latent frames after the reference image's, with
    the noisy and conditioning latents and mask packed into its input channels, the pose video's T latent frames, the
    face video in pixels at its motion encoder's size (one frame per video frame), CLIP image tokens and the prompt."""
    frames, face = FRAMES[1], config["motion_encoder_size"]
    return {"hidden_states": torch.randn(BATCH, config["in_channels"], 1 + frames, SIDE, SIDE),
            "pose_hidden_states": torch.randn(BATCH, config["latent_channels"], frames, SIDE, SIDE),
            "face_pixel_values": torch.rand(BATCH, 3, 1 + 4 * (frames - 1), face, face) * 2 - 1,
            "encoder_hidden_states_image": torch.randn(BATCH, TEXT_TOKENS, config["image_dim"]),
            "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["text_dim"])}


def _minimax_h3(config: dict[str, Any]) -> dict[str, Any]:
    """MiniMax-H3's pipeline for a first-frame request: the packed sequence [text | keyframe rows | stereo audio rows,
    channel-major | video rows] with the (t, h, w) rotary grid, modality tags and row indices its layout step builds
    (2 of the prompt's rows are the keyframe's vision block, tagged video), and its timestep step's distinct timesteps
    with each row's index into them (video and audio on their own schedules in [0, 1], the keyframe held at 0.999).
    The grid is float32, as the pipeline sends it to a device without float64 (the model's rotary casts to it)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_TEXT_TAG,
        MINIMAX_H3_VIDEO_TAG,
    )

    text_tags = torch.full((TEXT_TOKENS,), MINIMAX_H3_TEXT_TAG)
    text_tags[2:4] = MINIMAX_H3_VIDEO_TAG
    patch, side = tuple(config["patch_size"]), SIDE // 2
    positions, tags, video, audio, text, keyframe_rows, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        text_tags, FRAMES[1], side, side, TEXT_TOKENS, patch, MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_VIDEO_TAG, ("first",))
    video_time, audio_time = (_timestep()[:2] / 1000).tolist()
    timesteps, indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio, keyframe_rows, 0, TEXT_TOKENS, video_time, audio_time, max(video_time, 0.999), 1.0)
    return {"hidden_states": torch.randn(BATCH, video.numel(), config["in_channels"] * patch[0] * patch[1] * patch[2]),
            "audio_hidden_states": torch.randn(BATCH, audio.numel(), config["audio_in_channels"]),
            "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["text_dim"]),
            "timestep": timesteps, "timestep_indices": indices, "token_tags": tags, "position_ids": positions.float(),
            "video_indices": video, "audio_indices": audio, "text_indices": text}


def _cosmos3_omni(model: nn.Module) -> dict[str, Any]:
    """Cosmos 3's image-to-video pipeline, the conditional pass of one step: the prompt's token ids, then the latent
    video's patches (its first latent frame the conditioning image's: no timestep, no prediction), the joint
    sequence's mRoPE positions (fps-modulated video time after the text and its modality margin) as its text and
    vision segment builders make them, and the step's timestep for every noisy patch."""
    from types import SimpleNamespace

    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    pipeline = SimpleNamespace(transformer=model, vae_scale_factor_temporal=4)  # its Wan 2.2 VAE's (the default)
    prompt = torch.randint(0, model.config.vocab_size, (TEXT_TOKENS,)).tolist()
    text = Cosmos3OmniPipeline._prepare_text_segment(pipeline, prompt, "cpu")
    latents = torch.randn(1, model.config.latent_channel, FRAMES[1], SIDE // 2, SIDE // 2)
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        pipeline, latents, has_image_condition=True, mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=float(model.config.base_fps), curr=text["und_len"], device="cpu", condition_frame_indexes=[0])
    return {"input_ids": text["input_ids"], "text_indexes": text["text_indexes"], "und_len": text["und_len"],
            "position_ids": torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
            "sequence_length": text["und_len"] + vision["num_vision_tokens"], "vision_tokens": [latents],
            "vision_timesteps": torch.full((vision["num_noisy_vision_tokens"],), float(_timestep()[0])),
            **{name: vision[name] for name in ("vision_token_shapes", "vision_sequence_indexes",
                                               "vision_mse_loss_indexes", "vision_noisy_frame_indexes")}}


def _wan_animate_2(config: dict[str, Any]) -> dict[str, Any]:
    """Wan Animate 2's pipeline, one segment of 1 + 4 (T - 1) frames at a 16x16 latent (128 pixels): the driving
    video's T latent frames with their conditioning (the i2v mask's 4 channels over the whole segment, then latents),
    the noisy latents of T + 1 frames (the reference image's first) with theirs (the mask over the reference image's
    frame), the prompt, CLIP image tokens, the step's timestep, the driving video's patch grid, and the frame count and
    pixel size of the video its block mask spans."""
    from diffusers.modular_pipelines.wan_animate_2.encoders import get_i2v_mask

    frames, side, latent = FRAMES[1], SIDE // 2, config["out_dim"]

    def condition(count: int, masked_pixel_frames: int) -> torch.Tensor:
        mask = get_i2v_mask(count, side, side, masked_pixel_frames, device="cpu")
        return torch.cat([mask, torch.randn(config["in_dim"] - latent - len(mask), count, side, side)])

    return {"latents": torch.randn(latent, frames + 1, side, side), "reference_latents": condition(frames + 1, 1),
            "driving_latents": torch.randn(latent, frames, side, side),
            "driving_condition": condition(frames, 1 + 4 * (frames - 1)),
            "encoder_hidden_states": torch.randn(TEXT_TOKENS, config["text_dim"]),
            "encoder_hidden_states_image": torch.randn(1, TEXT_TOKENS, 1280),  # its CLIP's width, fixed in the model
            "timestep": _timestep()[:1],
            "reference_grid_sizes": torch.tensor([[frames, side // config["patch_size"][1],
                                                   side // config["patch_size"][2]]]),
            "origin_len": 1 + 4 * (frames - 1), "origin_area": [side * 8, side * 8]}


# Inputs of classes whose forward the generic rules cannot feed (a batch of frames, a condition of its own shape),
# built from the config by the model's own conventions (as its pipeline passes them); the generic rules fill in the
# arguments a rule leaves out.
CLASS_INPUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    # Frames folded into the batch, their count passed beside.
    "TransformerTemporalModel": lambda config: {
        "hidden_states": torch.randn(BATCH * FRAMES[1], _channels(config), SIDE // 4, SIDE // 4),
        "num_frames": FRAMES[1], "encoder_hidden_states": None},  # no cross-attention: self-attention twice
    # CLIP image embeddings: the noisy one, its projection and the text tokens, all of the embedding width.
    "PriorTransformer": lambda config: {
        "hidden_states": torch.randn(BATCH, config["embedding_dim"]),
        "proj_embedding": torch.randn(BATCH, config["embedding_dim"]),
        "encoder_hidden_states": torch.randn(BATCH, config["num_embeddings"], config["embedding_dim"])},
    # A video, its few conditioned frames with their mask, and the text per frame (AnimateDiff repeats it).
    "SparseControlNetModel": lambda config: {
        "sample": torch.randn(BATCH, _channels(config), FRAMES[1], SIDE, SIDE),
        "controlnet_cond": torch.randn(BATCH, config["conditioning_channels"], FRAMES[1], SIDE, SIDE),
        "conditioning_mask": (torch.rand(BATCH, 1, FRAMES[1], SIDE, SIDE) > 0.5).float(),
        "encoder_hidden_states": _text(config, BATCH * FRAMES[1])},
    # Text states with their lengths (the shorter padded).
    "ErnieImageTransformer2DModel": lambda config: {
        "text_bth": torch.randn(BATCH, TEXT_TOKENS, config["text_in_dim"]),
        "text_lens": torch.tensor([TEXT_TOKENS, TEXT_TOKENS - 3])},
    # A text encoder's states and the target tokenizer's ids it is rewritten into.
    "AnimaTextConditioner": lambda config: {
        "source_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["source_dim"]),
        "target_input_ids": torch.randint(0, config["target_vocab_size"], (BATCH, TEXT_TOKENS))},
    # The autoregressive prior's image tokens, one per latent patch, a random few dropped.
    "GlmImageTransformer2DModel": lambda config: {
        "prior_token_id": torch.randint(0, config["prior_vq_quantizer_codebook_size"],
                                        (BATCH, (SIDE // config["patch_size"]) ** 2)),
        "prior_token_drop": torch.rand(BATCH, (SIDE // config["patch_size"]) ** 2) < 0.2,
        "target_size": torch.tensor([[SIDE * 8.0, SIDE * 8.0]] * BATCH),
        "crop_coords": torch.zeros(BATCH, 2)},
    "Ideogram4Transformer2DModel": lambda config: _ideogram_packed(config),
    "HunyuanDiT2DModel": lambda config: _hunyuan_dit(config),
    "HunyuanDiT2DControlNetModel": lambda config: _hunyuan_dit(config) | {
        "controlnet_cond": torch.randn(BATCH, config["in_channels"], SIDE, SIDE)},  # the control image's latents
    # Forwards that sample noise (the consistency decoder its starting and step noise, VidTok its latent from the
    # posterior, as its forward does by default): a CPU generator (re-seeded at each call) gives both devices the
    # same noise, which diffusers draws on the generator's device and moves.
    "ConsistencyDecoderVAE": lambda config: {"generator": torch.Generator()},
    "AutoencoderVidTok": lambda config: {"generator": torch.Generator()},
    # The note and continuous encoders' outputs with their masks, spectrogram frames and the noise time in [0, 1).
    "T5FilmDecoder": lambda config: {
        "encodings_and_masks": [(torch.randn(BATCH, TEXT_TOKENS, config["d_model"]),
                                 torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)),
                                (torch.randn(BATCH, 4, config["d_model"]), torch.ones(BATCH, 4, dtype=torch.bool))],
        "decoder_input_tokens": torch.randn(BATCH, 16, config["input_dims"])},
    "LuminaNextDiT2DModel": lambda config: _lumina_next(config),
    "StableAudioDiTModel": lambda config: _stable_audio(config),
    "OmniGenTransformer2DModel": lambda config: _omnigen(config),
    # A latent waveform, the prompt's states and the duration's global vector, of the widths it configures; its
    # timestep in [0, 1], as its forward documents.
    "StableAudio3DiTModel": lambda config: {"timestep": _timestep() / 1000,
        "hidden_states": torch.randn(BATCH, config["io_channels"], LENGTH),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["cond_token_dim"]),
        "global_hidden_states": torch.randn(BATCH, config["global_cond_dim"])},
    # Frame-aligned conditioning (one row per latent frame) and flow-matching time in [0, 1] (1 is data).
    "MiniMaxMusic3Transformer1DModel": lambda config: {
        "hidden_states": torch.randn(BATCH, config["in_channels"], LENGTH),
        "encoder_hidden_states": torch.randn(BATCH, LENGTH, config["condition_dim"]),
        "timestep": 1 - _timestep() / 1000},
    # The prompt's LLM states, its glyph (ByT5) states and an image's vision embeddings, each with its mask, as its
    # image-to-video pipeline passes them.
    "HunyuanVideo15Transformer3DModel": lambda config: {
        "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["text_embed_dim"]),
        "encoder_attention_mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
        "encoder_hidden_states_2": torch.randn(BATCH, 4, config["text_embed_2_dim"]),
        "encoder_attention_mask_2": torch.ones(BATCH, 4, dtype=torch.long),
        "image_embeds": torch.randn(BATCH, 4, config["image_embed_dim"])},
    # Latent video and the upscale factor of one of its models (x2).
    "Kandinsky6SRLatentUpscalerBank": lambda config: {
        "latents": torch.randn(BATCH, config["in_channels"], FRAMES[1], SIDE // 2, SIDE // 2),
        "scale": config["scales"][0]},
    "AceStepTransformer1DModel": lambda config: _ace_step(config),
    # Per-frame hidden states of the autoregressive stage, its condition layers concatenated.
    "MiniMaxMusic3ConditionEncoder": lambda config: {"hidden_states": torch.randn(
        BATCH, 16, config["num_condition_layers"] * config["condition_hidden_dim"])},
    # The control image (at 8x the latent's side) its ControlNet-XS half encodes.
    "UNetControlNetXSModel": lambda config: {
        "controlnet_cond": torch.randn(BATCH, config["ctrl_conditioning_channels"], SIDE * 8, SIDE * 8)},
    # A mono waveform (batch, samples): it adds the channel itself.
    "MMAudioVAE": lambda config: {"sample": torch.randn(BATCH, 16 * LENGTH)},
    # Latent frames as tokens (batch, length, latent width) and the prompt's states with their mask.
    "LongCatAudioDiTTransformer": lambda config: {
        "hidden_states": torch.randn(BATCH, LENGTH, config["latent_dim"]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["dit_text_dim"])},
    "Kandinsky5Transformer3DModel": lambda config: _kandinsky5(config),
    "Kandinsky6Transformer3DModel": lambda config: _kandinsky6(config),
    "Kandinsky6SRTransformer3DModel": lambda config: _kandinsky6(config),
    "CosmosTransformer3DModel": lambda config: _cosmos(config),
    "CosmosControlNetModel": lambda config: _cosmos(config, control=True),
    # Two control images (at 8x the latent's side) of two of its control types, each with its scale.
    "ControlNetUnionModel": lambda config: {
        "controlnet_cond": [torch.randn(BATCH, config["conditioning_channels"], SIDE * 8, SIDE * 8) for _ in range(2)],
        "control_type": torch.tensor([[1.0, 0.0, 1.0] + [0.0] * (config["num_control_type"] - 3)] * BATCH),
        "control_type_idx": [0, 2], "conditioning_scale": [1.0, 0.5]},
    # Packed latent tokens of a side/2 grid; the vision-language sequence is the prompt's tokens then one slot per
    # 2x2 latent tokens of the target image (img_mask marks those slots).
    "QwenImage21Transformer2DModel": lambda config: {
        "hidden_states": torch.randn(BATCH, (SIDE // 2) ** 2, config["in_channels"]),
        "img_shapes": [[(1, SIDE // 2, SIDE // 2)]] * BATCH,
        "img_mask": torch.cat([torch.zeros(TEXT_TOKENS, dtype=torch.bool),
                               torch.ones((SIDE // 4) ** 2, dtype=torch.bool)]).expand(BATCH, -1).contiguous()},
    "SanaWMTransformer3DModel": lambda config: _sana_wm(config),
    "LTX2VideoTransformer3DModel": lambda config: _ltx2(config),
    "AnyFlowTransformer3DModel": lambda config: _anyflow(config),
    # The T5 states, the chosen Llama layers' states stacked first, and the pooled CLIP states, as its pipeline (which
    # leaves the image ids to the model).
    "HiDreamImageTransformer2DModel": lambda config: {
        "encoder_hidden_states_t5": torch.randn(BATCH, TEXT_TOKENS, config["caption_channels"][0]),
        "encoder_hidden_states_llama3": torch.randn(len(config["llama_layers"]), BATCH, TEXT_TOKENS,
                                                    config["caption_channels"][1]),
        "pooled_embeds": torch.randn(BATCH, config["text_emb_dim"]), "timesteps": _timestep(), "img_ids": None},
    # The text encoder's features: the Perceiver's bundle then one per injection block; noise level in [0, 1].
    "BriaFibo2Transformer2DModel": lambda config: {
        "hidden_states": torch.randn(BATCH, config["in_channels"], SIDE, SIDE), "timestep": _timestep() / 1000,
        "encoder_hidden_states": torch.randn(BATCH, 1 + len(config["injection_layer_ids"]), TEXT_TOKENS,
                                             config["cap_feat_dim"])},
    # Patchified latents of the target image then one reference image, each an 8x8 patch grid of one frame, their
    # (t, h, w) per sample, and the prompt's states with their mask.
    "JoyImageEditPlusTransformer3DModel": lambda config: {
        "hidden_states": torch.randn(BATCH, 2 * 8 * 8, config["in_channels"], *config["patch_size"]),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, config["text_dim"]),
        "encoder_hidden_states_mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
        "shape_list": [[(1, 8, 8), (1, 8, 8)]] * BATCH},
    # Its causal rollout (no KV cache: the training path), one frame per chunk.
    "AnyFlowFARTransformer3DModel": lambda config: _anyflow(config) | {"chunk_partition": [1] * FRAMES[1]},
    "HunyuanVideoFramepackTransformer3DModel": lambda config: _framepack(config),
    "WanAnimateTransformer3DModel": _wan_animate,
    "MiniMaxH3Transformer3DModel": _minimax_h3,
    "WanAnimate2Transformer3DModel": _wan_animate_2,
    # A latent video and the prompt's states once per frame (AnimateDiff's pipeline repeats them).
    "UNetMotionModel": lambda config: {
        "sample": torch.randn(BATCH, config["in_channels"], FRAMES[1], SIDE, SIDE),
        "encoder_hidden_states": _text(config, BATCH * FRAMES[1])},
    # Per-token latents and backbone CA positions (nm) of a protein chain its pipeline decodes, with token types and
    # the two conditioning flags its decoder reads (no in-context tokens; every token carries a local latent).
    "RFD4ProteinaAutoencoder": lambda config: {
        "z_latent": torch.randn(BATCH, TEXT_TOKENS, config["latent_dim"]),
        "ca_coors_nm": torch.randn(BATCH, TEXT_TOKENS, 3),
        "padding_mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool),
        "token_type": torch.randint(0, config["num_token_types"], (BATCH, TEXT_TOKENS)),
        "conditioning": {"is_in_context_conditioning": torch.zeros(BATCH, TEXT_TOKENS, dtype=torch.bool),
                         "supports_local_latent": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.bool)}},
    # The control video (VACE's masked frames and mask, packed into its input channels) beside the latent video.
    "WanVACETransformer3DModel": lambda config: {
        "hidden_states": torch.randn(BATCH, config["in_channels"], FRAMES[1], SIDE, SIDE),
        "control_hidden_states": torch.randn(BATCH, config["vace_in_channels"], FRAMES[1], SIDE, SIDE)},
}


def _ltx2_compression(config: Any, axis: str) -> int:
    """LTX-2's VAE's compression along `axis` ("spatial" or "temporal"): its patch times 2 per downsampler of that
    kind (its spatial_compression_ratio attribute counts every stage as both)."""
    patch = config.patch_size if axis == "spatial" else config.patch_size_t
    return patch * 2 ** sum(kind in (axis, "spatiotemporal") for kind in config.downsample_type)


# Inputs a pipeline asks the model itself for (a rotary table its own position embedding builds).
MODEL_INPUTS: dict[str, Callable[[nn.Module], dict[str, Any]]] = {
    "Cosmos3OmniTransformer": _cosmos3_omni,
    # Video VAEs whose compression sets the smallest video they take. LTX-2's: 1 + 8k frames and a latent 2 wide
    # (its 3x3 reflect padding needs 2), at 32x spatial compression 64 pixels.
    "AutoencoderKLLTX2Video": lambda model: {"sample": torch.randn(
        BATCH, model.config.in_channels, 1 + _ltx2_compression(model.config, "temporal"),
        2 * _ltx2_compression(model.config, "spatial"), 2 * _ltx2_compression(model.config, "spatial"))},
    # Allegro's encodes and decodes only tile by tile: one tile (its kernel: 24 frames of its sample size), at batch 1
    # (it copies each tile into a batch-1 buffer).
    "AutoencoderKLAllegro": lambda model: {"sample": torch.randn(1, model.config.in_channels, *model.kernel)},
    # MiniMax-H3's encodes `clip_length`-frame clips and drops `token_drop` latent frames from the end, and its decoder
    # cross-fades consecutive clips: two clips are the fewest it decodes.
    "AutoencoderKLMiniMaxH3": lambda model: {"sample": torch.randn(
        BATCH, model.config.in_channels, 2 * model.config.clip_length, SIDE, SIDE)},
    # HunyuanVideo 1.5's: its mid-block attention's causal mask has the batch but no head axis (diffusers 0.42.1), which
    # broadcasts against the attention only for one video: one, as its pipeline decodes one per prompt.
    "AutoencoderKLHunyuanVideo15": lambda model: {"sample": torch.randn(
        1, model.config.in_channels, 1 + model.temporal_compression_ratio, SIDE, SIDE)},
    # SANA-WM's refiner, one block of its sliding window as its refiner pipeline runs it: the block's latent tokens,
    # the prompt's states and mask, one timestep per token (sigma times the model's scale) and the rotary table of
    # the block's absolute frame positions.
    "SanaWMLTX2RefinerTransformer3DModel": lambda model: {
        "hidden_states": torch.randn(BATCH, FRAMES[1] * (SIDE // 2) ** 2, model.config.in_channels),
        "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, model.config.caption_channels),
        "encoder_attention_mask": torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long),
        "timestep": torch.rand(BATCH, 1).expand(BATCH, FRAMES[1] * (SIDE // 2) ** 2).contiguous()
        * model.config.timestep_scale_multiplier,
        "video_rotary_emb": model.build_rotary_emb_for_absolute_positions(
            batch_size=BATCH, frame_positions=list(range(FRAMES[1])), height=SIDE // 2, width=SIDE // 2,
            device=torch.device("cpu"), fps=24.0)},
    # Z-Image's ControlNet, fused with its transformer: per sample (as lists) one latent image (channels, 1 frame,
    # height, width) of the width the transformer's 2x2 patch embedder takes, the prompt's states of its caption
    # embedder's width and the VAE-encoded control image; the timestep as the schedule's fraction (the model scales it).
    "ZImageControlNetModel": lambda model: {
        "x": list(torch.randn(BATCH, model.all_x_embedder["2-1"].in_features // 4, 1, SIDE, SIDE).unbind(0)),
        "t": _timestep() / 1000,
        "cap_feats": list(torch.randn(BATCH, TEXT_TOKENS, model.cap_embedder[-1].in_features).unbind(0)),
        "control_context": list(torch.randn(BATCH, model.config.control_in_dim, 1, SIDE, SIDE).unbind(0))},
}


# Optional forward arguments a model needs in practice (its output is not defined without them).
USED_OPTIONAL = ("timestep", "encoder_hidden_states", "pooled_projections", "img_ids", "txt_ids", "img_shapes",
                 "text_encoder_layers")


# Channel counts tried after the configured one: what the config names the model's own input, an RGB image or
# video (autoencoders configured by their latent width), a mono or stereo waveform.
OTHER_CHANNELS = ("input_channels", "encoder_in_channels", "num_mels", "in_dim")
# Config lists whose product is an audio model's hop (samples per latent frame): its length is one hop at least.
HOP_FACTORS = ("downsampling_ratios", "encoder_rates", "strides", "upsample_rates")


def _hop(config: dict[str, Any]) -> int:
    """The product of the first stride list the config has (1 where it has none)."""
    for name in HOP_FACTORS:
        value = config.get(name)
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            product = 1
            for factor in value:
                product *= factor
            return product
    return 1


def _layouts(config: dict[str, Any], class_name: str, fractions: bool = False) -> Iterator[_Shapes]:
    """The candidate input layouts, the one the class name suggests first; then the same with other channel counts
    and, for 1-D signals, a length of two hops."""
    video = any(word in class_name for word in ("Video", "3D", "Temporal", "Motion", "Wan", "Mochi", "Allegro",
                                                  "Cosmos", "Magvit", "Latte", "I2VGen", "Hunyuan", "Sana"))
    audio = any(word in class_name for word in ("Audio", "1D", "Oobleck", "Music", "Vocoder"))
    order = ["sequence", "image", "video", "tokens"] if audio else (
        ["video", "frames-first video", "image", "tokens", "sequence"] if video
        else ["image", "tokens", "video", "frames-first video", "sequence"])
    for layout in [*order, "vector"]:
        for frames in (FRAMES if "video" in layout else (1,)):
            yield _Shapes(config, layout, frames, fractions)
    configured = _channels(config)
    named = [_config_int(config, (name,), None) for name in OTHER_CHANNELS]
    for layout in order:
        others = (1, 2) if layout == "sequence" else (3,)
        lengths = (LENGTH, 2 * _hop(config)) if layout == "sequence" else (LENGTH,)
        for channels in dict.fromkeys(c for c in (*named, *others, configured) if c is not None):
            for length in dict.fromkeys(lengths):
                if channels == configured and length == LENGTH:
                    continue
                for frames in (FRAMES if "video" in layout else (1,)):
                    yield _Shapes(config, layout, frames, fractions, channels, length)


def synthesize_inputs(model: nn.Module, class_name: str) -> dict[str, Any]:
    """Inputs the model's forward accepts on CPU: the first candidate layout that runs."""
    parameters = inspect.signature(model.forward).parameters
    required = [name for name, p in parameters.items() if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not required and not any(p.kind == p.VAR_POSITIONAL for p in parameters.values()):
        raise Skip("its forward takes no inputs (it is run inside another model)")
    config = dict(getattr(model, "config", {}) or {})
    optional = USED_OPTIONAL + NEEDED_OPTIONAL.get(class_name, ())
    wanted = required + [name for name in optional if name in parameters and name not in required]
    if "guidance" in parameters and config.get("guidance_embeds"):
        wanted.append("guidance")
    if "class_labels" in parameters and (config.get("num_embeds_ada_norm") or config.get("num_class_embeds")):
        wanted.append("class_labels")
    errors: list[str] = []
    rule, model_rule = CLASS_INPUTS.get(class_name), MODEL_INPUTS.get(class_name)
    for shapes in _layouts(config, class_name, _takes_fractions(model)):
        given = (rule(config) if rule else {}) | (model_rule(model) if model_rule else {})
        try:
            inputs = {name: _argument(name, shapes) for name in wanted if name not in given} | given
        except KeyError as missing:
            raise Skip(f"the zoo has no rule for its forward argument {missing.args[0]!r}") from None
        try:
            with torch.no_grad():
                model(**inputs)
            return inputs
        except Exception as error:
            errors.append(f"{shapes.layout}: {first_line(error)}")
    raise Skip(f"no input layout runs on CPU either (image, video, tokens, 1-D, vector); {errors[0]}")


def _meta_parameters(model_class: Callable[..., nn.Module], arguments: dict[str, Any]) -> int:
    """Parameters counted on the meta device, before any memory is taken (0 where it does not build there)."""
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in model_class(**arguments).parameters())
    except Exception:
        return 0


def build_diffusers(case: Case) -> tuple[nn.Module, dict[str, Any]]:
    """The class built small with random float32 weights on CPU, and inputs its forward accepts."""
    import diffusers.models as models

    model_class: Callable[..., nn.Module] = getattr(models, case.model_class)
    if case.model_class in COMBINED:
        return _build_combined(model_class, COMBINED[case.model_class])
    if case.model_class in FUSED_ADAPTERS:
        return _build_fused(model_class)
    reasons: list[Skip] = []
    for heads in (True, False):  # head counts kept where a width is tied to heads x head size
        try:
            return _build_small(model_class, case.model_class, heads)
        except Skip as reason:
            reasons.append(reason)
    raise reasons[0]


# Classes that combine models of another class (multi-ControlNets, MultiAdapter): built from two of those, with one
# condition image and one scale per model.
COMBINED = {"MultiControlNetModel": "ControlNetModel", "SD3MultiControlNetModel": "SD3ControlNetModel",
            "FluxMultiControlNetModel": "FluxControlNetModel",
            "QwenImageMultiControlNetModel": "QwenImageControlNetModel",
            "HunyuanDiT2DMultiControlNetModel": "HunyuanDiT2DControlNetModel",
            "MultiControlNetUnionModel": "ControlNetUnionModel", "MultiAdapter": "T2IAdapter"}
# Combined classes that take one model and run it once per condition (Qwen-Image's, for its union ControlNet).
ONE_MODEL_PER_CONDITION = ("QwenImageMultiControlNetModel",)
# Per-model inputs of a combined class other than the generic ones, from one part's inputs: Flux's multi-ControlNet
# indexes each model's control mode (ignored by a ControlNet that is not a union); a union ControlNet takes a list
# of control images, their control types and scales.
COMBINED_INPUTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "FluxMultiControlNetModel": lambda part: {"controlnet_mode": [torch.zeros(BATCH, dtype=torch.long)] * 2},
    "MultiControlNetUnionModel": lambda part: {
        "controlnet_cond": [part["controlnet_cond"], [torch.randn_like(c) for c in part["controlnet_cond"]]],
        "control_type": [part["control_type"]] * 2, "control_type_idx": [part["control_type_idx"]] * 2,
        "conditioning_scale": [part["conditioning_scale"], [0.8, 0.4]]}}


def _build_combined(model_class: Callable[..., nn.Module], part: str) -> tuple[nn.Module, dict[str, Any]]:
    case = Case(part, family(part), "diffusion", model_class=part, library="diffusers")
    try:
        first, part_inputs = build_diffusers(case)
        nets = [first] if model_class.__name__ in ONE_MODEL_PER_CONDITION else [first, build_diffusers(case)[0]]
    except Skip as reason:
        raise Skip(f"it combines {part}s, which the zoo cannot run: {reason}") from None
    models_argument = next(iter(inspect.signature(model_class.__init__).parameters.keys() - {"self"}))
    model = model_class(**{models_argument: nets}).float().eval()
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > MAX_PARAMETERS:
        raise Skip(f"{parameters / 1e6:.0f}M parameters as two {part}s, over the zoo's {MAX_PARAMETERS / 1e6:.0f}M")
    per_model = {"controlnet_cond": [part_inputs.get("controlnet_cond"), None], "conditioning_scale": [1.0, 0.5],
                 "controlnet_mode": [None, None], "xs": [part_inputs.get("x"), None], "adapter_weights": [0.6, 0.4],
                 "return_dict": False,  # it zips its models' outputs as tuples, as pipelines call it
                 } | COMBINED_INPUTS.get(model_class.__name__, lambda part: {})(part_inputs)
    inputs = {}
    for name in inspect.signature(model.forward).parameters:
        if name in per_model:
            value = per_model[name]
            first = value[0] if isinstance(value, list) else None
            second_condition = isinstance(first, torch.Tensor) and value[1] is None  # the first model's, redrawn
            inputs[name] = [first, torch.randn_like(first)] if second_condition else value
        elif name in part_inputs:
            inputs[name] = part_inputs[name]
    try:
        with torch.no_grad():
            model(**inputs)
    except Exception as error:
        raise Skip(f"its forward fails on CPU with two {part}s: {first_line(error)}") from None
    return model, inputs


UP_BLOCKS = {"CrossAttnDownBlock2D": "CrossAttnUpBlock2D", "DownBlock2D": "UpBlock2D"}  # a UNet's mirror blocks


class Fusion(NamedTuple):
    """How a pipeline runs an adapter that does not run alone: inside a model of class `host` built with the
    arguments the adapter fixes, joined by `fuse(diffusers.models, host, adapter)`; the result is fed as class
    `fed_as` is."""

    host: str
    host_arguments: Callable[[dict[str, Any]], dict[str, Any]]
    fuse: Callable[[Any, nn.Module, nn.Module], nn.Module]
    fed_as: str


FUSED_ADAPTERS: dict[str, Fusion] = {
    # ControlNet-XS: its blocks hold two resnets each, like SD's UNet; widths, text width and attention layout its own.
    "ControlNetXSAdapter": Fusion("UNet2DConditionModel", lambda adapter: {
        "block_out_channels": adapter["base_block_out_channels"], "cross_attention_dim": adapter["cross_attention_dim"],
        "down_block_types": adapter["down_block_types"],
        "up_block_types": tuple(UP_BLOCKS[block] for block in reversed(adapter["down_block_types"])),
        "use_linear_projection": adapter["use_linear_projection"],
        "upcast_attention": adapter["upcast_attention"], "layers_per_block": 2},
        lambda models, unet, adapter: models.UNetControlNetXSModel.from_unet(unet, adapter), "UNetControlNetXSModel"),
    # AnimateDiff's motion modules: one per resnet of the UNet (as many layers per block) at the UNet's widths.
    "MotionAdapter": Fusion("UNet2DConditionModel", lambda adapter: {
        "block_out_channels": adapter["block_out_channels"], "layers_per_block": adapter["motion_layers_per_block"]},
        lambda models, unet, adapter: models.UNetMotionModel.from_unet2d(unet, adapter), "UNetMotionModel"),
    # Z-Image's ControlNet borrows the transformer's embedders and refiners (its width and heads) and runs itself.
    "ZImageControlNetModel": Fusion("ZImageTransformer2DModel", lambda adapter: {
        "dim": adapter["dim"], "n_heads": adapter["n_heads"], "n_kv_heads": adapter["n_kv_heads"]},
        lambda models, transformer, controlnet: models.ZImageControlNetModel.from_transformer(controlnet, transformer),
        "ZImageControlNetModel"),
}


def _build_fused(adapter_class: Callable[..., nn.Module]) -> tuple[nn.Module, dict[str, Any]]:
    """The adapter built small, fused into its small host model the way its pipeline loads it."""
    import diffusers.models as models

    fusion = FUSED_ADAPTERS[adapter_class.__name__]
    adapter = adapter_class(**small_arguments(adapter_class))
    host_class = getattr(models, fusion.host)
    host = host_class(**small_arguments(host_class) | fusion.host_arguments(dict(adapter.config)))
    model = fusion.fuse(models, host, adapter)
    if not hasattr(model, "gradient_checkpointing"):  # ZImageControlNetModel's __init__ leaves it unset (diffusers
        model.gradient_checkpointing = False  # 0.42.1), so its forward fails with gradients on, as in training
    randomize_constant_matrices(model, 0.02)  # zero-initialised output projections would hide the adapter
    model = model.float().eval()
    return model, synthesize_inputs(model, fusion.fed_as)


class WanAnimate2Segment(nn.Module):
    """One segment of Wan Animate 2's pipeline as one call: its reference pass over the driving video's segment fills
    a new KV cache, then one denoising step of the segment's latents attends to that cache through the model's
    in-context block mask, as its denoise loop runs them (the mask, which the model keeps, is rebuilt at each call, so
    it is on the device the call runs on)."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.config = transformer.config

    def forward(self, latents: torch.Tensor, reference_latents: torch.Tensor, driving_latents: torch.Tensor,
                driving_condition: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_image: torch.Tensor, timestep: torch.Tensor, reference_grid_sizes: torch.Tensor,
                origin_len: int, origin_area: list[int]) -> Any:
        from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

        def tokens(video: torch.Tensor) -> int:  # the patches of a (channels, frames, height, width) latent
            return math.prod(size // step for size, step in zip(video.shape[1:], self.config.patch_size))

        self.transformer.block_masks.clear()
        shared = {"encoder_hidden_states": [encoder_hidden_states], "timestep": timestep,
                  "encoder_hidden_states_image": encoder_hidden_states_image,
                  "kv_cache": WanAnimate2KVCache(self.config.num_layers)}
        self.transformer([driving_latents], condition_latents=[driving_condition], kv_cache_mode="extract",
                         seq_len=tokens(driving_latents), offset_grid_sizes=reference_grid_sizes, **shared)
        return self.transformer([latents], condition_latents=[reference_latents], kv_cache_mode="cached",
                                seq_len=tokens(latents), reference_grid_sizes=reference_grid_sizes,
                                origin_len=origin_len, origin_area=origin_area, **shared)


# Classes whose pipeline runs the model in more than one call per step: the zoo runs the module that makes those calls.
PIPELINE_CALLS: dict[str, Callable[[nn.Module], nn.Module]] = {"WanAnimate2Transformer3DModel": WanAnimate2Segment}


# What a class's pipeline calls on the model before running it.
PIPELINE_SETUP: dict[str, Callable[[nn.Module], None]] = {
    "AutoencoderKLAllegro": lambda model: model.enable_tiling(),  # its forward has no untiled path
}


def _build_small(model_class: Callable[..., nn.Module], name: str, heads: bool) -> tuple[nn.Module, dict[str, Any]]:
    for widths in (False, True):
        arguments = small_arguments(model_class, widths, heads)
        parameters = _meta_parameters(model_class, arguments)
        if parameters <= MAX_PARAMETERS:
            break
    if parameters > MAX_PARAMETERS:
        raise Skip(f"{parameters / 1e6:.0f}M parameters when shrunk, over the zoo's {MAX_PARAMETERS / 1e6:.0f}M")
    try:
        model = model_class(**arguments)
    except ImportError as error:
        raise Skip(f"needs a package not installed: {first_line(error)}") from None
    except Exception as error:
        raise Skip(f"the shrunk model does not build on CPU: {first_line(error)}") from None
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > MAX_PARAMETERS:
        raise Skip(f"{parameters / 1e6:.0f}M parameters when shrunk, over the zoo's {MAX_PARAMETERS / 1e6:.0f}M")
    randomize_constant_matrices(model, 0.02)  # zero-initialised output projections would hide the whole model
    model = model.float().eval()
    PIPELINE_SETUP.get(name, lambda model: None)(model)
    model = PIPELINE_CALLS.get(name, lambda model: model)(model)
    return model, synthesize_inputs(model, name)
