"""The training core end to end on a plain torch model: loss, equivalences, resume, errors."""

from __future__ import annotations

import copy

import pytest
import torch

from lowvram_lora.training.checkpointing import CheckpointConfig, Checkpointer, Mode
from lowvram_lora.training.data import TrainingData
from lowvram_lora.training.lora import LoRAConfig, attach_lora
from lowvram_lora.training.loop import LoRATrainer, NonFiniteLossError, ResumePoint, TrainConfig
from lowvram_lora.training.objectives import NoiseSchedule, ObjectiveConfig
from lowvram_lora.training.optim import OptimizerConfig
from lowvram_lora.training.state import TrainingState, load_state, save_state
from toy_models import make_toy_denoiser

TARGETS = (r"blocks\.\d+\.(qkv|proj|ff1|ff2)$",)


def flow_schedule() -> NoiseSchedule:
    return NoiseSchedule("flow", lambda u: u.float())


def eps_schedule() -> NoiseSchedule:
    # A discrete-ish VE schedule: sigma from 0.03 to 15 log-linearly in u.
    return NoiseSchedule("eps", lambda u: torch.exp(torch.log(torch.tensor(0.03)) * (1 - u) + torch.log(torch.tensor(15.0)) * u).float())


class Setup:
    """A frozen toy denoiser with LoRA attached, its data and a Denoiser callable."""

    def __init__(self, *, images=4, seed=0, dropout=0.0, checkpoint: str | None = None, conditionings=None):
        self.model = make_toy_denoiser(dropout=dropout).train()
        generator = torch.Generator().manual_seed(100)
        self.latents = [torch.randn(4, 6, 6, generator=generator) for _ in range(images)]
        count = images if conditionings is None else conditionings
        self.contexts = [torch.randn(1, 5, 32, generator=generator) for _ in range(count)]
        self.data = TrainingData(tuple(self.latents), conditioning_count=count)
        self.lora = attach_lora(self.model, LoRAConfig(rank=4, targets=TARGETS), generator=torch.Generator().manual_seed(seed))
        self.checkpointer = (
            Checkpointer(self.model, CheckpointConfig(Mode(checkpoint), budget_bytes=10**6)) if checkpoint else None
        )

    def denoiser(self, x_t, sigma, conditions):
        context = torch.cat([self.contexts[i] for i in conditions])
        return self.model(x_t, sigma, context, {})

    def trainer(self, config: TrainConfig, schedule=None, resume=None) -> LoRATrainer:
        return LoRATrainer(
            parameters=list(self.lora.parameters()),
            denoiser=self.denoiser,
            schedule=schedule or flow_schedule(),
            data=self.data,
            config=config,
            device="cpu",
            checkpointer=self.checkpointer,
            resume=resume,
        )


def config(**kwargs) -> TrainConfig:
    optimizer = kwargs.pop("optimizer", OptimizerConfig(learning_rate=3e-3))
    return TrainConfig(**{"steps": 10, "seed": 7, "optimizer": optimizer, **kwargs})


def assert_states_close(a: dict, b: dict, rtol=1e-5):
    assert a.keys() == b.keys()
    for key in a:
        scale = a[key].abs().max().item() + 1e-12
        assert (a[key] - b[key]).abs().max().item() <= rtol * scale, key


def held_out_loss(setup: Setup, schedule: NoiseSchedule) -> float:
    """The objective on fixed noise at fixed levels: comparable before and after training."""
    from lowvram_lora.training.objectives import noisy_input, prediction_target

    generator = torch.Generator().manual_seed(5)
    x0 = torch.stack(setup.latents)
    total = 0.0
    with torch.no_grad():
        for u in (0.2, 0.4, 0.6, 0.8):
            noise = torch.randn(x0.shape, generator=generator)
            sigma = schedule.sigma_from_level(torch.full((len(x0),), u, dtype=torch.float64))
            x_t = noisy_input(schedule.prediction, x0, noise, sigma)
            target = prediction_target(schedule.prediction, x0, noise, sigma)
            total += float((setup.denoiser(x_t, sigma, list(range(len(x0)))) - target).square().mean())
    return total / 4


@pytest.mark.parametrize("schedule", [flow_schedule, eps_schedule])
def test_training_lowers_the_loss_on_a_fixed_latent(schedule):
    setup = Setup(images=1)
    before = held_out_loss(setup, schedule())
    result = setup.trainer(config(steps=40, optimizer=OptimizerConfig(learning_rate=1e-2)), schedule()).run()
    assert len(result.losses) == 40 and all(l > 0 for l in result.losses)
    after = held_out_loss(setup, schedule())
    assert after < 0.9 * before, (before, after)


@pytest.mark.parametrize("mode", ["full", "every_n", "budget"])
def test_checkpointing_does_not_change_the_trained_adapter(mode):
    plain = Setup(dropout=0.1)
    plain.trainer(config(steps=6, batch_size=2)).run()
    planned = Setup(dropout=0.1, checkpoint=mode)
    result = planned.trainer(config(steps=6, batch_size=2)).run()
    assert_states_close(plain.lora.state(), planned.lora.state())
    assert result.plans  # the plan was recorded for the report
    assert any(p.checkpointed for p in result.plans.values()) or mode == "budget"


def test_gradient_accumulation_equals_one_big_batch():
    # SGD: the update is linear in the gradient, so the comparison measures the gradients (Adam's
    # first steps are +-lr whatever the size of a near-zero gradient, which magnifies rounding).
    sgd = OptimizerConfig(name="sgd", learning_rate=0.05)
    a = Setup(images=4)
    a.trainer(config(steps=3, batch_size=2, grad_accumulation=2, optimizer=sgd)).run()
    b = Setup(images=4)
    b.trainer(config(steps=3, batch_size=4, grad_accumulation=1, optimizer=sgd)).run()
    assert_states_close(a.lora.state(), b.lora.state())


def test_resuming_n_then_m_steps_equals_n_plus_m(tmp_path):
    whole = Setup(images=3)
    whole.trainer(config(steps=7)).run()

    first = Setup(images=3)
    result = first.trainer(config(steps=4)).run()
    path = save_state(
        tmp_path / "state.safetensors",
        TrainingState(result.end_step, first.lora.state(), {"rank": 4}, result.optimizer_state, result.scaler_state),
    )
    state = load_state(path)
    assert state.step == 4
    second = Setup(images=3)
    second.lora.load_state(state.adapters)
    second.trainer(config(steps=3), resume=ResumePoint(state.step, state.optimizer, state.scaler)).run()
    assert_states_close(whole.lora.state(), second.lora.state(), rtol=1e-6)


def test_same_seed_same_lora_whatever_the_global_rng_did():
    torch.manual_seed(1)
    a = Setup(dropout=0.2)
    a.trainer(config(steps=3)).run()
    torch.manual_seed(999)
    torch.rand(1000)
    b = Setup(dropout=0.2)
    b.trainer(config(steps=3)).run()
    assert_states_close(a.lora.state(), b.lora.state(), rtol=0)
    c = Setup(dropout=0.2)
    c.trainer(config(steps=3, seed=8)).run()
    assert any(not torch.equal(a.lora.state()[k], c.lora.state()[k]) for k in a.lora.state())


def test_attach_train_detach_leaves_the_base_model_bit_identical():
    setup = Setup()
    x, sigma, context = torch.randn(2, 4, 6, 6), torch.tensor([0.5, 0.9]), torch.randn(2, 5, 32)
    setup.lora.detach()
    before = setup.model(x, sigma, context, {})
    base = copy.deepcopy(setup.model.state_dict())
    setup.lora = attach_lora(setup.model, LoRAConfig(rank=4, targets=TARGETS), generator=torch.Generator().manual_seed(0))
    setup.trainer(config(steps=3)).run()
    assert not torch.equal(setup.model(x, sigma, context, {}), before)  # the LoRA does something
    setup.lora.detach()
    assert torch.equal(setup.model(x, sigma, context, {}), before)
    for key, value in setup.model.state_dict().items():
        assert torch.equal(value, base[key]), key


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_fp32_adapters(precision):
    setup = Setup(images=1)
    result = setup.trainer(config(steps=4, precision=precision)).run()
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert all(p.dtype == torch.float32 for p in setup.lora.parameters())
    assert any(p.abs().sum() > 0 for name, p in setup.lora.named_parameters() if "lora_up" in name)


def test_non_finite_loss_stops_and_keeps_the_last_good_adapter():
    setup = Setup(images=1)
    trainer = setup.trainer(config(steps=5))
    calls = {"n": 0}
    denoise = setup.denoiser

    def poisoned(x_t, sigma, conditions):
        calls["n"] += 1
        out = denoise(x_t, sigma, conditions)
        return out * float("nan") if calls["n"] == 3 else out

    trainer.denoiser = poisoned
    snapshots = []
    with pytest.raises(NonFiniteLossError, match="step 3") as error:
        trainer.run(on_step=lambda report: snapshots.append(setup.lora.state()))
    assert len(snapshots) == 2 and error.value.result.end_step == 2
    assert_states_close(snapshots[-1], setup.lora.state(), rtol=0)


def test_min_snr_weighting_changes_training_for_eps_and_is_refused_for_flow():
    # SGD and several levels per batch: a per-step scalar weight would vanish under Adam.
    sgd = OptimizerConfig(name="sgd", learning_rate=0.05)
    a, b = Setup(images=4), Setup(images=4)
    a.trainer(config(steps=2, batch_size=4, optimizer=sgd), eps_schedule()).run()
    b.trainer(config(steps=2, batch_size=4, optimizer=sgd, objective=ObjectiveConfig(min_snr_gamma=5.0)), eps_schedule()).run()
    assert any(not torch.allclose(a.lora.state()[k], b.lora.state()[k]) for k in a.lora.state())
    with pytest.raises(ValueError, match="min_snr_gamma"):
        Setup().trainer(config(objective=ObjectiveConfig(min_snr_gamma=5.0)), flow_schedule())


def test_a_single_conditioning_serves_every_image():
    setup = Setup(images=3, conditionings=1)
    assert len(setup.trainer(config(steps=2)).run().losses) == 2


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: TrainingData((), 1), "latents"),
        (lambda: TrainingData((torch.randn(4, 2, 2),) * 3, 2), "conditioning"),
        (lambda: OptimizerConfig(learning_rate=0), "learning_rate"),
        (lambda: OptimizerConfig(learning_rate=-1e-4), "learning_rate"),
        (lambda: LoRAConfig(rank=0).validate(), "rank"),
        (lambda: TrainConfig(steps=0), "steps"),
        (lambda: TrainConfig(steps=1, batch_size=0), "batch_size"),
        (lambda: TrainConfig(steps=1, precision="fp8"), "precision"),
        (lambda: attach_lora(make_toy_denoiser(), LoRAConfig(targets=("nothing_here",)), generator=torch.Generator()), "targets"),
    ],
)
def test_bad_input_names_the_input(make, field):
    with pytest.raises(ValueError, match=field):
        make()
