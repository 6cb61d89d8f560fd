"""diffusers on pjrt: a UNet with cross-attention, an AutoencoderKL, a DiT and DDIM/DDPM sampling loops against CPU,
in strict eager, fused eager and compiled modes (tiny configs, random weights, nothing downloaded).

Runs in .venv-libs (`make test-libs`); skipped where diffusers is not installed.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers")
sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "libs"))
import diffusers_models  # noqa: E402
from support import to_device  # noqa: E402

MODES = ("strict", "fused", "compiled")


def run_on_pjrt(model: torch.nn.Module, call: object, inputs: tuple, mode: str) -> torch.Tensor:
    model = model.to("pjrt")
    if mode == "compiled":
        model = torch.compile(model, backend="pjrt")
    eager_mode = "defer_and_fuse" if mode == "fused" else "defer_never"
    with torch.no_grad(), torch.pjrt.set_eager_mode(eager_mode):
        result = call(model, *to_device(inputs))
        assert result.device.type == "pjrt"
        return result.cpu()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(diffusers_models.CASES))
def test_matches_cpu(case: str, mode: str) -> None:
    build, make_inputs, call = diffusers_models.CASES[case]
    torch.manual_seed(0)
    model = build().eval()
    inputs = make_inputs(torch.Generator().manual_seed(1))
    on_pjrt = copy.deepcopy(model)
    with torch.no_grad():
        expected = call(model, *inputs)
    actual = run_on_pjrt(on_pjrt, call, inputs, mode)
    assert expected.abs().max() > 0.1  # a real signal, not a vanishing one
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_unet_training_step_matches_cpu() -> None:
    """The denoising loss of one DDPM training step, its gradients and an SGD update."""
    torch.manual_seed(0)
    model = diffusers_models.unet()
    on_pjrt = copy.deepcopy(model).to("pjrt")
    generator = torch.Generator().manual_seed(2)
    latents, text = torch.randn(2, 4, 16, 16, generator=generator), torch.randn(2, 7, 32, generator=generator)
    noise, timesteps = torch.randn(latents.shape, generator=generator), torch.tensor([17, 801])
    scheduler = diffusers_models.DDPMScheduler(num_train_timesteps=1000)
    noisy = scheduler.add_noise(latents, noise, timesteps)
    losses = []
    for net, device in ((model, "cpu"), (on_pjrt, "pjrt")):
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        predicted = net(noisy.to(device), timesteps.to(device), encoder_hidden_states=text.to(device)).sample
        loss = torch.nn.functional.mse_loss(predicted, noise.to(device))
        loss.backward()
        optimizer.step()
        losses.append(loss.detach().cpu())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for trained, reference in zip(on_pjrt.parameters(), model.parameters()):
        torch.testing.assert_close(trained.grad.cpu(), reference.grad, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(trained.cpu(), reference, rtol=1e-4, atol=1e-5)


ZOO_SLICE = ("AutoencoderKL", "DiTTransformer2DModel")


def test_the_zoo_catalog_is_every_model_class_diffusers_exports() -> None:
    import diffusers.models
    from diffusers import ModelMixin

    from torch_pjrt.cli import zoo

    cases = zoo.select_cases(library="diffusers")
    exported = {name for name in dir(diffusers.models) if isinstance(getattr(diffusers.models, name), type)
                and issubclass(getattr(diffusers.models, name), ModelMixin)}
    assert {c.key for c in cases} == exported - {"ModelMixin", "AutoModel"}
    assert {c.family for c in cases if c.key in ("UNet2DConditionModel", "AutoencoderKL", "FluxTransformer2DModel",
                                                 "ControlNetModel", "PriorTransformer", "T2IAdapter")} == {
        "unet", "autoencoder", "transformer", "controlnet", "prior", "adapter"}


def test_the_zoo_synthesises_each_models_own_inputs() -> None:
    """A packed-token transformer gets tokens with their position ids, a video transformer 5-D latents."""
    from torch_pjrt.cli import zoo, zoo_catalog

    def built(name: str) -> tuple[torch.nn.Module, dict]:
        return zoo.build_case(zoo_catalog.Case(name, "transformer", "diffusion", model_class=name,
                                                    library="diffusers"))

    flux, inputs = built("FluxTransformer2DModel")
    tokens = inputs["hidden_states"].shape[1]
    assert inputs["hidden_states"].shape == (2, tokens, flux.config.in_channels)
    assert inputs["img_ids"].shape == (tokens, 3) and inputs["encoder_hidden_states"].shape[-1] == 4096
    _, inputs = built("WanTransformer3DModel")
    assert inputs["hidden_states"].dim() == 5


def test_the_zoo_builds_from_each_models_own_code() -> None:
    """Flux scales its timestep by 1000 itself, so it gets a fraction; DiT gets steps; Flux2's position ids have
    one column per rotary axis; a class whose defaults leave in_channels to a checkpoint builds with an override;
    SD3, whose caption width is tied to heads x head size, builds with its head count kept."""
    from torch_pjrt.cli import zoo, zoo_catalog

    def built(name: str) -> tuple[torch.nn.Module, dict]:
        return zoo.build_case(zoo_catalog.Case(name, "transformer", "diffusion", model_class=name,
                                                    library="diffusers"))

    _, inputs = built("FluxTransformer2DModel")
    assert 0 <= inputs["timestep"].min() and inputs["timestep"].max() < 1
    _, inputs = built("DiTTransformer2DModel")
    assert inputs["timestep"].min() >= 50
    krea2, inputs = built("Krea2Transformer2DModel")  # scaled by 1e3 inside its time embedding's forward
    assert inputs["timestep"].max() < 1 and inputs["encoder_hidden_states"].shape[2] == krea2.config.num_text_layers
    flux2, inputs = built("Flux2Transformer2DModel")
    assert inputs["img_ids"].shape[1] == len(flux2.config.axes_dims_rope) == 4
    transformer, _ = built("Transformer2DModel")
    assert transformer.config.in_channels == 32
    sd3, _ = built("SD3Transformer2DModel")
    assert sd3.config.num_attention_heads * sd3.config.attention_head_dim == sd3.config.caption_projection_dim
    multi, inputs = built("MultiControlNetModel")
    assert len(multi.nets) == len(inputs["controlnet_cond"]) == len(inputs["conditioning_scale"]) == 2


def test_the_zoo_tries_a_models_own_channels_and_lengths_and_class_rules() -> None:
    """A VAE configured by its latent width gets an RGB image; an audio autoencoder a waveform two hops long; a
    video ControlNet its conditioned frames with their mask and the text once per frame."""
    from torch_pjrt.cli import zoo, zoo_catalog, zoo_diffusers

    def built(name: str) -> tuple[torch.nn.Module, dict]:
        return zoo.build_case(zoo_catalog.Case(name, "autoencoder", "diffusion", model_class=name,
                                                    library="diffusers"))

    vae, inputs = built("ConsistencyDecoderVAE")
    assert inputs["sample"].shape[1] == vae.config.encoder_in_channels == 3
    oobleck, inputs = built("AutoencoderOobleck")
    hop = zoo_diffusers._hop(dict(oobleck.config))
    assert inputs["sample"].shape == (2, oobleck.config.audio_channels, 2 * hop) and hop == 2048
    sparse, inputs = built("SparseControlNetModel")
    frames = inputs["sample"].shape[2]
    assert inputs["controlnet_cond"].shape[1] == sparse.config.conditioning_channels
    assert inputs["conditioning_mask"].shape == (2, 1, frames, *inputs["sample"].shape[3:])
    assert inputs["encoder_hidden_states"].shape[0] == 2 * frames


def test_a_model_that_samples_noise_draws_the_same_noise_at_every_call() -> None:
    """VidTok samples its latent from the posterior in its forward (by default): fed without a generator, two calls
    differ (as CPU and pjrt, each drawing its own noise, did); with the zoo's CPU generator, re-seeded at each
    call, they are equal, so both devices decode the same latent."""
    from torch_pjrt.cli import zoo, zoo_catalog

    model, inputs = zoo.build_case(zoo_catalog.Case("AutoencoderVidTok", "autoencoder", "diffusion",
                                                    model_class="AutoencoderVidTok", library="diffusers"))
    assert isinstance(inputs["generator"], torch.Generator)
    unseeded = {name: value for name, value in inputs.items() if name != "generator"}
    with torch.no_grad():
        first, second = (zoo._call(model, inputs).sample for _ in range(2))
        assert torch.equal(first, second)
        assert not torch.allclose(zoo._call(model, unseeded).sample, zoo._call(model, unseeded).sample)


def test_video_vaes_get_the_smallest_video_their_compression_takes() -> None:
    """LTX-2's VAE 1 + 8 frames at 64 pixels (32x spatial, 8x temporal compression; its own
    spatial_compression_ratio says 64), MiniMax-H3's two of its encoder clips, HunyuanVideo 1.5's one video,
    Allegro's one tile (tiling on, as its pipeline sets it): each built and run on CPU by the zoo (a smaller video
    fails there)."""
    from torch_pjrt.cli import zoo, zoo_catalog, zoo_diffusers

    def built(name: str) -> tuple[torch.nn.Module, dict]:
        return zoo.build_case(zoo_catalog.Case(name, "autoencoder", "diffusion", model_class=name, library="diffusers"))

    ltx2, inputs = built("AutoencoderKLLTX2Video")
    assert inputs["sample"].shape == (2, 3, 9, 64, 64) and ltx2.spatial_compression_ratio == 64
    with torch.no_grad(), pytest.raises(RuntimeError):
        ltx2(torch.randn(2, 3, 9, 32, 32))
    minimax, inputs = built("AutoencoderKLMiniMaxH3")
    assert inputs["sample"].shape[2] == 2 * minimax.config.clip_length
    with torch.no_grad(), pytest.raises(ValueError):
        minimax(inputs["sample"][:, :, : minimax.config.clip_length])
    _, inputs = built("AutoencoderKLHunyuanVideo15")
    assert inputs["sample"].shape[0] == 1
    allegro, inputs = built("AutoencoderKLAllegro")  # tiled, as its pipeline runs it: one tile
    assert allegro.use_tiling and inputs["sample"].shape == (1, 3, *allegro.kernel) and min(allegro.stride) > 0
    assert zoo_diffusers._ltx2_compression(ltx2.config, "spatial") == 32


def test_the_zoo_feeds_models_as_their_pipelines_do() -> None:
    """Ideogram4 gets model time in [0, 1] (its sinusoid scales it by 1e4); a union multi-ControlNet gets, per model,
    a list of control images with their control types and scales; Stable Audio its duration as one global token,
    with a rotary table spanning that token and the waveform; OmniGen one sequence of prompt (an input image's
    latent tokens in it), time token and output image, with its processor's mask and positions."""
    from torch_pjrt.cli import zoo, zoo_catalog

    def built(name: str) -> tuple[torch.nn.Module, dict]:
        return zoo.build_case(zoo_catalog.Case(name, "transformer", "diffusion", model_class=name,
                                                    library="diffusers"))

    _, inputs = built("Ideogram4Transformer2DModel")
    assert 0 < inputs["timestep"].min() and inputs["timestep"].max() < 1
    multi, inputs = built("MultiControlNetUnionModel")
    assert len(multi.nets) == len(inputs["controlnet_cond"]) == len(inputs["control_type"]) == 2
    assert all(len(images) == len(indices) == 2 for images, indices in zip(inputs["controlnet_cond"],
                                                                            inputs["control_type_idx"]))
    assert not torch.equal(inputs["controlnet_cond"][0][0], inputs["controlnet_cond"][1][0])
    _, inputs = built("StableAudioDiTModel")
    cos, sin = inputs["rotary_embedding"]
    assert cos.shape[0] == sin.shape[0] == inputs["hidden_states"].shape[2] + inputs["global_hidden_states"].shape[1]
    omnigen, inputs = built("OmniGenTransformer2DModel")  # prompt, time token, output image: one sequence
    output_tokens = (inputs["hidden_states"].shape[-1] // omnigen.config.patch_size) ** 2
    length = inputs["input_ids"].shape[1] + 1 + output_tokens
    assert inputs["attention_mask"].shape == (2, length, length) and inputs["position_ids"].shape == (2, length)
    assert inputs["attention_mask"][0, :-output_tokens, -output_tokens:].sum() == 0  # the prompt does not see it
    start, end = inputs["input_image_sizes"][0][0]
    assert (end - start) * omnigen.config.patch_size ** 2 == inputs["input_img_latents"][0][0, 0].numel()


def test_the_zoo_runs_an_adapter_inside_the_model_its_pipeline_fuses_it_into() -> None:
    """ControlNet-XS's adapter runs as a UNetControlNetXSModel holding the adapter's weights, AnimateDiff's motion
    adapter as a UNetMotionModel holding its motion modules, Z-Image's ControlNet with its transformer's embedders;
    each is fed as the fused model's pipeline feeds it, and its output depends on the adapter's weights."""
    import diffusers.models as models

    from torch_pjrt.cli import zoo, zoo_catalog

    def built(name: str) -> tuple[torch.nn.Module, dict]:
        return zoo.build_case(zoo_catalog.Case(name, "adapter", "diffusion", model_class=name, library="diffusers"))

    def output(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        with torch.no_grad():
            return torch.cat([tensor.flatten() for _, tensor in zoo._tensors(model(**inputs))
                              if tensor.is_floating_point()])

    xs, xs_inputs = built("ControlNetXSAdapter")
    assert isinstance(xs, models.UNetControlNetXSModel)
    assert xs_inputs["controlnet_cond"].shape[1] == xs.config.ctrl_conditioning_channels
    motion, motion_inputs = built("MotionAdapter")
    assert isinstance(motion, models.UNetMotionModel) and len(motion.down_blocks[0].motion_modules) == 1
    assert motion_inputs["encoder_hidden_states"].shape[0] == 2 * motion_inputs["sample"].shape[2]  # once per frame
    controlnet, controlnet_inputs = built("ZImageControlNetModel")
    assert controlnet.t_embedder is not None and len(controlnet_inputs["control_context"]) == 2
    for model, inputs, adapter_part in ((xs, xs_inputs, "ctrl_"), (motion, motion_inputs, "motion_modules"),
                                        (controlnet, controlnet_inputs, "control_layers")):
        before = output(model, inputs)
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if adapter_part in name:
                    parameter.mul_(1.5)
        assert not torch.allclose(output(model, inputs), before), type(model).__name__


def test_wan_animate_gets_a_segment_with_its_pose_latents_and_face_video() -> None:
    """Wan Animate is fed one pipeline segment: pose latents one frame short of the latents (the reference image's
    frame), a face video of 1 + 4 (T - 1) frames at its motion encoder's size, and a face adapter that reads it."""
    from torch_pjrt.cli import zoo, zoo_catalog

    name = "WanAnimateTransformer3DModel"
    model, inputs = zoo.build_case(zoo_catalog.Case(name, "transformer", "diffusion", model_class=name,
                                                    library="diffusers"))
    latent_frames = inputs["pose_hidden_states"].shape[2]
    assert inputs["hidden_states"].shape[2] == latent_frames + 1 and len(model.face_adapter) >= 1
    face = model.config.motion_encoder_size
    assert inputs["face_pixel_values"].shape[2:] == (1 + 4 * (latent_frames - 1), face, face)
    with torch.no_grad():
        before = model(**inputs).sample
        other_face = torch.rand_like(inputs["face_pixel_values"]) * 2 - 1
        after = model(**inputs | {"face_pixel_values": other_face}).sample
    assert before.shape == (2, model.config.out_channels, latent_frames + 1, *inputs["hidden_states"].shape[3:])
    assert not torch.allclose(before, after)  # the face video reaches the output


def test_packed_multimodal_transformers_get_their_pipelines_layout() -> None:
    """MiniMax-H3 gets its layout step's packed sequence (text, a keyframe, stereo audio, video) with its timestep
    step's per-row timesteps; Cosmos 3 Omni its text and vision segments, the conditioning frame left out of the
    prediction; in both the video's prediction depends on the other rows of the sequence."""
    from torch_pjrt.cli import zoo, zoo_catalog

    def built(name: str) -> tuple[torch.nn.Module, dict]:
        return zoo.build_case(zoo_catalog.Case(name, "transformer", "diffusion", model_class=name,
                                                    library="diffusers"))

    def video_output(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
        with torch.no_grad():
            return model(**inputs, return_dict=False)[0]

    minimax, inputs = built("MiniMaxH3Transformer3DModel")
    rows = inputs["position_ids"].shape[0]
    indices = torch.cat([inputs["text_indices"], inputs["video_indices"], inputs["audio_indices"]])
    assert sorted(indices.tolist()) == list(range(rows)) and inputs["token_tags"].shape == (rows,)
    assert (inputs["token_tags"][inputs["audio_indices"]] == 2).all()
    assert (inputs["token_tags"][inputs["video_indices"]] == 0).all()
    row_times = inputs["timestep"][inputs["timestep_indices"]]
    video_times, audio_times = row_times[inputs["video_indices"]], row_times[inputs["audio_indices"]]
    assert 0 < (video_times == 0.999).sum() < video_times.numel()  # the keyframe's rows, held near clean
    assert (audio_times == audio_times[0]).all() and not (video_times == audio_times[0]).any()
    assert inputs["timestep"].numel() == 3 and 0 < inputs["timestep"].min() and inputs["timestep"].max() <= 1
    before = video_output(minimax, inputs)
    after = video_output(minimax, inputs | {"audio_hidden_states": torch.randn_like(inputs["audio_hidden_states"])})
    assert before.shape == inputs["hidden_states"].shape and not torch.allclose(before, after)

    cosmos, inputs = built("Cosmos3OmniTransformer")
    assert inputs["position_ids"].shape == (3, inputs["sequence_length"])
    frames, height, width = inputs["vision_token_shapes"][0]
    assert inputs["vision_noisy_frame_indexes"][0].tolist() == list(range(1, frames))
    noisy_patches = (frames - 1) * height * width
    assert inputs["vision_mse_loss_indexes"].numel() == inputs["vision_timesteps"].numel() == noisy_patches
    before = video_output(cosmos, inputs)[0]
    after = video_output(cosmos, inputs | {"input_ids": torch.randint_like(inputs["input_ids"], 1000)})[0]
    assert before.shape == inputs["vision_tokens"][0].shape and before[:, :, 0].abs().max() == 0
    assert not torch.allclose(before, after)  # the generation stream reads the prompt


def test_wan_animate_2_runs_a_segment_through_its_kv_cache() -> None:
    """Wan Animate 2 runs as its pipeline runs a segment: the reference pass over the driving video fills a new KV
    cache, which the denoising step of the segment (one frame longer: the reference image's) reads through the block
    mask built for that call; the driving video reaches the output only through that cache."""
    from torch_pjrt.cli import zoo, zoo_catalog, zoo_diffusers

    name = "WanAnimate2Transformer3DModel"
    model, inputs = zoo.build_case(zoo_catalog.Case(name, "transformer", "diffusion", model_class=name,
                                                    library="diffusers"))
    assert isinstance(model, zoo_diffusers.WanAnimate2Segment)
    frames = inputs["driving_latents"].shape[1]
    assert inputs["latents"].shape[1] == inputs["reference_latents"].shape[1] == frames + 1
    assert inputs["reference_grid_sizes"].tolist() == [[frames, *(s // 2 for s in inputs["latents"].shape[2:])]]
    with torch.no_grad():
        before = model(**inputs).sample[0]
        assert len(model.transformer.block_masks) == 1
        after = model(**inputs | {"driving_latents": torch.randn_like(inputs["driving_latents"])}).sample[0]
    assert before.shape == inputs["latents"].shape and not torch.allclose(before, after)


def test_a_fixed_zoo_slice_matches_cpu() -> None:
    from torch_pjrt.cli import zoo

    cases = [c for c in zoo.select_cases(library="diffusers") if c.key in ZOO_SLICE]
    rows = zoo.run_cases(cases, isolate=False)
    assert [row["key"] for row in rows] == list(ZOO_SLICE)
    for row in rows:
        assert row["status"] == "match" and not row.get("float64_criterion"), row
