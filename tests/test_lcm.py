"""Unit tests of training_utils.lcm: the skipping-step DDIM solver, the consistency boundary scalings, the
predictions of every type, guidance and the loss, against diffusers' schedulers where they compute the same."""

import pytest
import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler, DDPMScheduler, LCMScheduler

from training_utils import lcm
from training_utils.args import training_parser
from training_utils.errors import UsageError
from training_utils.outputs.hub import LORA_HOW_TO_LOAD

# SD's training schedule.
SCHEDULE = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear"}


def noise_scheduler(prediction_type="epsilon"):
    return DDPMScheduler(**SCHEDULE, prediction_type=prediction_type)


def test_the_solver_schedule_is_every_kth_timestep_ending_at_the_last():
    solver = lcm.DDIMSolver(noise_scheduler().alphas_cumprod, num_ddim_timesteps=50)
    assert solver.step_ratio == 20
    assert torch.equal(solver.timesteps, torch.arange(19, 1000, 20))
    torch.manual_seed(0)
    index, start, end = solver.sample(64, "cpu")
    assert torch.equal(start, solver.timesteps[index])
    assert torch.equal(end, (start - 20).clamp(min=0))
    assert index.min() >= 0 and index.max() < 50 and len(set(index.tolist())) > 10


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_a_solver_step_is_ddim_schedulers_step_on_the_same_timesteps(prediction_type):
    """DDIMScheduler with trailing spacing walks the same timesteps; eta 0, the last step to alphas_cumprod[0]."""
    scheduler = noise_scheduler(prediction_type)
    ddim = DDIMScheduler(**SCHEDULE, prediction_type=prediction_type, timestep_spacing="trailing",
                         set_alpha_to_one=False, clip_sample=False)
    ddim.set_timesteps(50)
    solver = lcm.DDIMSolver(scheduler.alphas_cumprod, num_ddim_timesteps=50)
    assert torch.equal(ddim.timesteps.flip(0), solver.timesteps)
    generator = torch.Generator().manual_seed(0)
    sample, output = (torch.randn(1, 4, 8, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    for index in (0, 1, 17, 49):
        timestep = solver.timesteps[index]
        expected = ddim.step(output, timestep, sample, eta=0.0).prev_sample
        at = torch.tensor([timestep])
        x0 = lcm.predicted_original_sample(output, at, sample, scheduler)
        noise = lcm.predicted_noise(output, at, sample, scheduler)
        torch.testing.assert_close(solver.step(x0, noise, torch.tensor([index])), expected, rtol=1e-6, atol=1e-6)


def test_boundary_scalings_are_lcm_schedulers_and_the_identity_at_zero():
    scheduler = LCMScheduler(**SCHEDULE)
    timesteps = torch.tensor([0, 1, 19, 500, 999])
    c_skip, c_out = lcm.boundary_scalings(timesteps, timestep_scaling=10.0)
    for t, skip, out in zip(timesteps.tolist(), c_skip, c_out):
        expected_skip, expected_out = scheduler.get_scalings_for_boundary_condition_discrete(t)
        assert skip.item() == pytest.approx(expected_skip, rel=1e-6)
        assert out.item() == pytest.approx(expected_out, rel=1e-6)
    assert (c_skip[0].item(), c_out[0].item()) == (1.0, 0.0)
    sample, output = torch.randn(5, 4, 2, 2), torch.randn(5, 4, 2, 2)
    boundary = lcm.consistency_output(output, timesteps, sample, noise_scheduler(), 10.0)
    assert torch.equal(boundary[0], sample[0])  # f(x, 0) = x


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction", "sample"])
def test_predictions_recover_the_clean_sample_and_noise_of_each_prediction_type(prediction_type):
    scheduler = noise_scheduler(prediction_type)
    generator = torch.Generator().manual_seed(1)
    clean, noise = (torch.randn(3, 4, 4, 4, generator=generator, dtype=torch.float64) for _ in range(2))
    timesteps = torch.tensor([10, 400, 900])
    sample = scheduler.add_noise(clean, noise, timesteps)
    output = {"epsilon": noise, "sample": clean, "v_prediction": scheduler.get_velocity(clean, noise, timesteps)}
    output = output[prediction_type]
    # (the schedule is fp32: so is the round trip's precision)
    for predicted, expected in ((lcm.predicted_original_sample, clean), (lcm.predicted_noise, noise)):
        torch.testing.assert_close(predicted(output, timesteps, sample, scheduler), expected, rtol=1e-5, atol=1e-5)


def test_guidance_scales_are_uniform_in_the_range_and_guidance_is_lcms():
    torch.manual_seed(0)
    w = lcm.sample_guidance_scales(1000, 3.0, 15.0, 4, "cpu", torch.float32)
    assert w.shape == (1000, 1, 1, 1) and w.min() >= 3.0 and w.max() <= 15.0 and w.std() > 3
    cond, uncond = torch.randn(2, 4), torch.randn(2, 4)
    assert torch.equal(lcm.guided(cond, uncond, 0.0), cond)
    torch.testing.assert_close(lcm.guided(cond, uncond, 2.0), 3 * cond - 2 * uncond)


def test_the_losses_are_l2_and_pseudo_huber():
    prediction, target = torch.randn(2, 4, 3, 3), torch.randn(2, 4, 3, 3)
    assert torch.equal(lcm.consistency_loss(prediction, target, "l2"), F.mse_loss(prediction, target))
    huber = lcm.consistency_loss(prediction, target, "huber", huber_c=0.001)
    torch.testing.assert_close(huber, (prediction - target).abs().mean(), atol=1e-3, rtol=0)
    assert lcm.consistency_loss(prediction, prediction, "huber").item() == 0


def lcm_parser():
    parser = training_parser("test")
    from training_utils.adapters.config import add_adapter_args
    add_adapter_args(parser)
    lcm.add_args(parser)
    return parser


def test_upstreams_spellings_are_the_pipeline_and_lora_flags():
    args = lcm_parser().parse_args(["--pretrained_teacher_model", "model", "--teacher_revision", "main",
                                    "--lora_rank", "8", "--interpolation_type", "lanczos"])
    assert (args.pretrained_model_name_or_path, args.revision, args.rank, args.image_interpolation_mode) == \
        ("model", "main", 8, "lanczos")
    assert (args.w_min, args.w_max, args.num_ddim_timesteps, args.loss_type, args.huber_c) == (3.0, 15.0, 50, "l2",
                                                                                                0.001)


@pytest.mark.parametrize("flags, message", [
    (["--w_min", "5", "--w_max", "4"], "--w_max=4.0: expected at least --w_min (5.0)"),
    (["--num_ddim_timesteps", "0"], "--num_ddim_timesteps=0: expected a positive count"),
    (["--huber_c", "0"], "--huber_c=0.0: expected a positive number"),
])
def test_bad_distillation_values_stop_in_one_line(flags, message):
    args = lcm_parser().parse_args(["--pretrained_model_name_or_path", "m", *flags])
    with pytest.raises(UsageError) as error:
        lcm.check_args(args)
    assert str(error.value) == message


def test_more_ddim_timesteps_than_training_timesteps_are_refused():
    args = lcm_parser().parse_args(["--pretrained_model_name_or_path", "m", "--num_ddim_timesteps", "1001"])
    with pytest.raises(UsageError, match="at most the scheduler's 1000 training timesteps"):
        lcm.check_args(args, 1000)


def test_the_loading_code_renders_with_lcm_scheduler_in_few_steps_without_guidance():
    code = lcm.with_lcm_scheduler(LORA_HOW_TO_LOAD.format(
        imports="P", pipeline_class="P", base_model="base", load_options="", output_dir="out", prompt="a cat"), 4)
    assert code.splitlines()[1:6] == [
        "from diffusers import LCMScheduler, P", "", 'pipe = P.from_pretrained("base")',
        "pipe.scheduler = LCMScheduler.from_config(pipe.scheduler.config)",
        'pipe.load_lora_weights("out")            # or "out/ema" for the EMA adapter']
    assert 'pipe("a cat", num_inference_steps=4, guidance_scale=1.0)' in code


def test_adapters_disabled_makes_the_student_the_teacher_and_restores_it_even_on_error(tiny_sd_pipe):
    from diffusers import UNet2DConditionModel

    from training_utils.adapters.injection import ATTENTION_PROJECTIONS, add_lora

    unet = UNet2DConditionModel.from_config(tiny_sd_pipe.unet.config)
    unet.load_state_dict(tiny_sd_pipe.unet.state_dict())
    add_lora(unet, 4, ATTENTION_PROJECTIONS)
    with torch.no_grad():
        for name, parameter in unet.named_parameters():
            if "lora_B" in name:
                parameter.fill_(0.1)
    inputs = (torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([500]),
              torch.randn(1, 4, unet.config.cross_attention_dim, generator=torch.Generator().manual_seed(1)))
    with torch.no_grad():
        student = unet(*inputs).sample
        with lcm.adapters_disabled(unet):
            teacher = unet(*inputs).sample
        with pytest.raises(RuntimeError), lcm.adapters_disabled(unet):
            raise RuntimeError
        again = unet(*inputs).sample
        # The stock UNet's weights are another copy: some CPUs round a last bit by the data's alignment.
        torch.testing.assert_close(teacher, tiny_sd_pipe.unet(*inputs).sample, rtol=0, atol=1e-6)
    assert not torch.equal(student, teacher) and torch.equal(again, student)


def student_parser():
    parser = training_parser("test")
    lcm.add_student_args(parser)
    lcm.add_args(parser)
    return parser


def test_a_full_distillation_keeps_its_ema_always_at_upstreams_decay_and_has_no_lora_rank():
    args = student_parser().parse_args(["--pretrained_teacher_model", "model", "--teacher_revision", "main"])
    assert (args.pretrained_model_name_or_path, args.revision) == ("model", "main")
    assert (args.use_ema, args.ema_decay, args.unet_time_cond_proj_dim) == (True, 0.95, 256)
    assert "--lora_rank" not in student_parser()._option_string_actions
    args = student_parser().parse_args(["--pretrained_model_name_or_path", "m", "--unet_time_cond_proj_dim", "0"])
    with pytest.raises(UsageError, match=r"^--unet_time_cond_proj_dim=0: expected a positive size$"):
        lcm.check_args(args)


def test_the_student_is_the_teacher_with_a_guidance_embedding_added(tiny_sd_pipe):
    from diffusers import UNet2DConditionModel

    teacher = tiny_sd_pipe.unet
    assert teacher.config.time_cond_proj_dim is None
    torch.manual_seed(0)
    student = lcm.student_unet(teacher, 8)
    assert type(student) is UNet2DConditionModel and student.config.time_cond_proj_dim == 8
    weights, teacher_weights = student.state_dict(), teacher.state_dict()
    assert weights.keys() - teacher_weights.keys() == {"time_embedding.cond_proj.weight"}
    assert all(torch.equal(weights[name], tensor) for name, tensor in teacher_weights.items())
    assert weights["time_embedding.cond_proj.weight"].abs().sum() > 0
    # The embedding is the only difference: without it the student computes what the teacher does (to rounding: the
    # CPU's kernels are not bitwise repeatable across modules here).
    inputs = (torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([500]),
              torch.randn(1, 4, teacher.config.cross_attention_dim, generator=torch.Generator().manual_seed(1)))
    w_embedding = tiny_sd_pipe.get_guidance_scale_embedding(torch.tensor([4.0]), embedding_dim=8)
    with torch.no_grad():
        torch.testing.assert_close(student(*inputs).sample, teacher(*inputs).sample, rtol=0, atol=1e-5)
        assert (student(*inputs, timestep_cond=w_embedding).sample - teacher(*inputs).sample).abs().max() > 1e-3
    # A teacher that has the embedding already keeps its size, and the student all of its weights.
    again = lcm.student_unet(student, 16)
    assert again.config.time_cond_proj_dim == 8
    assert all(torch.equal(again.state_dict()[name], tensor) for name, tensor in weights.items())


def test_the_loading_code_of_a_distilled_unet_renders_at_its_guidance_scale():
    code = lcm.with_lcm_scheduler(LORA_HOW_TO_LOAD.format(
        imports="P", pipeline_class="P", base_model="base", load_options="", output_dir="out", prompt="a cat"), 4, 7.5)
    assert 'pipe("a cat", num_inference_steps=4, guidance_scale=7.5)' in code
